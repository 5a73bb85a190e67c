"""Python backend: a model.py defining a class (TritonPythonModel or Model) with
`initialize(args)`, `execute(inputs) -> outputs` on a whole batch of numpy arrays,
and `finalize()`. The model's code runs with the server's rights: see
docs/architecture.md, "Trust boundary"."""
from __future__ import annotations

import importlib.util
import json
import sys

from ..errors import ConfigError


class Backend:
    def __init__(self, spec):
        name = f"shmserve_model_{spec.name}_{spec.version}"
        loader = importlib.util.spec_from_file_location(name, spec.path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        loader.loader.exec_module(module)
        cls = getattr(module, "TritonPythonModel", None) or getattr(module, "Model", None)
        if cls is None:
            raise ConfigError(f"{spec.path}: defines neither TritonPythonModel nor Model")
        self.model = cls()
        if hasattr(self.model, "initialize"):
            self.model.initialize({
                "model_name": spec.name,
                "model_version": str(spec.version),
                "model_repository": spec.path.rsplit("/", 2)[0],
                "model_config": json.dumps({"parameters": spec.parameters,
                                            "max_batch_size": spec.max_batch_size}),
                "parameters": dict(spec.parameters),
            })

    def execute(self, inputs):
        return self.model.execute(inputs)

    def close(self):
        if hasattr(self.model, "finalize"):
            self.model.finalize()
