"""Runs a python model's `TritonPythonModel.auto_complete_config` in a process of its
own (model code never runs in the coordinator: an import that hangs, crashes or
prints cannot take the server with it). Started by server/autocomplete.py:

    python -m shmserve.backends.python_autocomplete <model.py> <result file>

The config so far comes as JSON on stdin; the completed config (ModelConfig.as_dict())
or {"error": "..."} goes to the result file. stdout and stderr are the server log.
"""
from __future__ import annotations

import json
import logging
import sys
import traceback


def main() -> int:
    path, result_path = sys.argv[1], sys.argv[2]
    logging.basicConfig(level="INFO", format="[shmserve auto-complete] %(message)s")
    try:
        from .. import pb_utils
        from .python_backend import import_model, model_class

        given = pb_utils.ModelConfig(sys.stdin.read())
        module, _ = import_model(path, "shmserve_auto_complete_model")
        returned = model_class(module, path).auto_complete_config(given)
        if not isinstance(returned, pb_utils.ModelConfig):
            raise TypeError("auto_complete_config must return the pb_utils.ModelConfig it was "
                            f"given (auto_complete_model_config), returned {type(returned).__name__}")
        result = {"config": returned.as_dict()}
    except Exception as e:  # the coordinator words the ConfigError
        traceback.print_exc(limit=4)
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if "config" in result else 1


if __name__ == "__main__":
    sys.exit(main())
