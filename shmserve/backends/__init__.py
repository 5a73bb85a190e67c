"""Model backends. Each runs inside a worker process and executes whole batches.

A backend is a class with `__init__(spec)`, `execute(inputs) -> outputs` (dicts of
numpy arrays keyed by tensor name, batch dimension first when the model batches)
and `close()`. Imports of heavy libraries stay inside the backend modules, in the
worker: a missing library makes that model UNAVAILABLE with the reason, never the
server fail. A backend module may define `check_config(cfg, where)`: the repository
calls it when it reads a config (no heavy import), to refuse or warn about the
backend's own parameters and options by name before any worker starts.

The python backend also takes the worker's Instance (model code sees its instance in
initialize's args and calls back into its server for BLS), and may execute per
request instead (`per_request`: Triton's python API, python_backend.py).
"""
from __future__ import annotations

import dataclasses
import importlib

_MODULES = {"python": "python_backend", "onnxruntime": "onnxruntime_backend",
            "pytorch": "pytorch_backend", "tensorrt": "tensorrt_backend"}


def _module(backend: str):
    return importlib.import_module(f"{__name__}.{_MODULES[backend]}")


@dataclasses.dataclass(frozen=True)
class Instance:
    """The model instance a worker runs, as model code may need it."""
    index: int = 0  # among the instances of its model
    server: str = "default"  # the server's name (`shmserve serve --name`)
    socket: str | None = None  # its control socket (BLS requests are a client's)


def load_backend(spec, instance: Instance | None = None):
    module = _module(spec.backend)
    if spec.backend == "python":
        return module.Backend(spec, instance or Instance())
    return module.Backend(spec)


def check_config(backend: str, cfg, where: str) -> None:
    """The backend's checks of a config (ConfigError or logged warnings), if it has any."""
    check = getattr(_module(backend), "check_config", None)
    if check is not None:
        check(cfg, where)
