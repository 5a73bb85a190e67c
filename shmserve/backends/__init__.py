"""Model backends. Each runs inside a worker process and executes whole batches.

A backend is a class with `__init__(spec, instance)`, `execute(inputs) -> outputs` (dicts of
numpy arrays keyed by tensor name, batch dimension first when the model batches)
and `close()`. Imports of heavy libraries stay inside the backend modules, in the
worker: a missing library makes that model UNAVAILABLE with the reason, never the
server fail. A backend module may define `check_config(cfg, where)`: the repository
calls it when it reads a config (no heavy import), to refuse or warn about the
backend's own parameters and options by name before any worker starts.

Every backend takes the worker's Instance: its device (the CPU or a GPU, as
server/devices.py planned it), and for python models what model code sees in
initialize's args (and its server, for BLS). The python backend may execute per
request instead (`per_request`: Triton's python API, python_backend.py).
"""
from __future__ import annotations

import dataclasses
import importlib

_MODULES = {"python": "python_backend", "onnxruntime": "onnxruntime_backend",
            "pytorch": "pytorch_backend", "tensorrt": "tensorrt_backend",
            "ensemble": "ensemble_backend"}


def _module(backend: str):
    return importlib.import_module(f"{__name__}.{_MODULES[backend]}")


@dataclasses.dataclass(frozen=True)
class Instance:
    """The model instance a worker runs, as model code may need it."""
    index: int = 0  # among the instances of its model
    server: str = "default"  # the server's name (`shmserve serve --name`)
    socket: str | None = None  # its control socket (BLS requests are a client's)
    device: int = -1  # -1 the CPU, else the server's GPU number (server/devices.py)
    cuda_pool_bytes: int = 0  # --cuda-memory-pool-byte-size for its GPU; 0: no cap

    @property
    def kind(self) -> str:
        return "CPU" if self.device < 0 else "GPU"


def load_backend(spec, instance: Instance | None = None):
    return _module(spec.backend).Backend(spec, instance or Instance())


def check_config(backend: str, cfg, where: str) -> None:
    """The backend's checks of a config (ConfigError or logged warnings), if it has any."""
    check = getattr(_module(backend), "check_config", None)
    if check is not None:
        check(cfg, where)
