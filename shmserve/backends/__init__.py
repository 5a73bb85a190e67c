"""Model backends. Each runs inside a worker process and executes whole batches.

A backend is a class with `__init__(spec)`, `execute(inputs) -> outputs` (dicts of
numpy arrays keyed by tensor name, batch dimension first when the model batches)
and `close()`. Imports of heavy libraries stay inside the backend modules.
"""
from __future__ import annotations

import importlib

_MODULES = {"python": "python_backend", "onnxruntime": "onnxruntime_backend"}


def load_backend(spec):
    module = importlib.import_module(f"{__name__}.{_MODULES[spec.backend]}")
    return module.Backend(spec)
