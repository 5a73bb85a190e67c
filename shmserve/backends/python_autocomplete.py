"""Runs a python model's `TritonPythonModel.auto_complete_config` in a process of its
own (model code never runs in the coordinator: an import that hangs, crashes or
prints cannot take the server with it). Started by server/autocomplete.py:

    python -m shmserve.backends.python_autocomplete <model.py> <result file>

On stdin, JSON: {"config": the config so far, "log": the server's LogOptions}; the
completed config ({"config": ModelConfig.as_dict()}) or {"error": "..."} goes to the
result file. The model's prints and pb_utils.Logger lines are server log lines.
"""
from __future__ import annotations

import json
import logging
import sys
import traceback

from ..logs import LogOptions, capture_model_output
from ..logs import setup as setup_logging


def main() -> int:
    path, result_path = sys.argv[1], sys.argv[2]
    message = json.loads(sys.stdin.read())
    setup_logging(LogOptions.from_dict(message["log"]), "auto-complete")
    who = f"model '{message['config'].get('name', '?')}' auto_complete_config"
    capture_model_output(who)
    try:
        from .. import pb_utils
        from ..pb_utils import logger
        from .python_backend import import_model, model_class

        logger.bind(who)
        given = pb_utils.ModelConfig(message["config"])
        module, _ = import_model(path, "shmserve_auto_complete_model")
        returned = model_class(module, path).auto_complete_config(given)
        if not isinstance(returned, pb_utils.ModelConfig):
            raise TypeError("auto_complete_config must return the pb_utils.ModelConfig it was "
                            f"given (auto_complete_model_config), returned {type(returned).__name__}")
        result = {"config": returned.as_dict()}
    except Exception as e:  # the coordinator words the ConfigError
        logging.getLogger("shmserve.autocomplete").warning(
            "%s raised: %s", path, traceback.format_exc(limit=4))
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if "config" in result else 1


if __name__ == "__main__":
    sys.exit(main())
