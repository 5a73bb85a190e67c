"""Python backend: a model.py defining a class TritonPythonModel (or Model) with
`initialize(args)`, `execute(...)` and `finalize()`, in one of two APIs:

- Triton's python model API (`import triton_python_backend_utils as pb_utils`,
  shmserve/pb_utils/): execute(requests) receives the requests of a dynamic batch as a
  list of pb_utils.InferenceRequest, whose input tensors view the callers' shared
  memory, and returns one pb_utils.InferenceResponse per request (its outputs, or its
  error); `async def execute` is awaited; BLS requests go through the server.
- the numpy-dict API: execute(inputs) receives the whole batch as {name: array}
  (requests concatenated along the batch dimension) and returns {name: array}. The
  fast path: no per-request objects. A model that wants each request's parameters
  declares execute(self, inputs, requests): `requests` is, per request of the batch in
  the order of its rows, (rows, parameters dict). (That model takes the worker's Python
  path; the others never pay for parameters.)

The rule: a model whose model.py (or what it imports while loading) imports
triton_python_backend_utils uses Triton's API, any other the numpy-dict API. The
config parameter `shmserve.python_api` ("triton" or "numpy") overrides it, e.g. for a
numpy-dict model that uses pb_utils.Logger.

The model's code runs with the server's rights: see docs/architecture.md, "Trust
boundary".
"""
from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import inspect
import os
import sys

from google.protobuf import text_format
from ..model_config import mc

from .. import pb_utils
from ..errors import ConfigError, UnavailableError
from ..pb_utils import bls, logger
from ..pb_utils.config import config_json
from ..pb_utils.errors import status_of
from ..pb_utils.messages import received, received_with_streams, response_arrays
from ..protocol import Status
from ..server import devices
from . import Instance

API_PARAMETER = "shmserve.python_api"
TRITON_API, NUMPY_API = "triton", "numpy"

_Tensor, _InferenceResponse = pb_utils.Tensor, pb_utils.InferenceResponse


class _PbUtilsFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import triton_python_backend_utils` with shmserve.pb_utils, and counts
    the imports that reached it (the first of a process does; later ones are cached)."""

    imports = 0

    def find_spec(self, name, path=None, target=None):
        if name != pb_utils.MODULE_NAME:
            return None
        self.imports += 1
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return pb_utils

    def exec_module(self, module):
        pass  # already executed as shmserve.pb_utils


_finder = _PbUtilsFinder()


def import_model(path: str, module_name: str):
    """Executes model.py as module `module_name`. Returns (module, whether loading it
    imported triton_python_backend_utils)."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    # Files next to model.py import as modules, as Triton's python stub allows (its
    # version directory is on sys.path); a worker serves one model, so no two clash.
    here = os.path.dirname(os.path.abspath(path))
    if here not in sys.path:
        sys.path.insert(0, here)
    before = _finder.imports
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    return module, _finder.imports > before


def model_class(module, path: str):
    cls = getattr(module, "TritonPythonModel", None) or getattr(module, "Model", None)
    if cls is None:
        raise ConfigError(f"{path}: defines neither TritonPythonModel nor Model")
    return cls


class Backend:
    def __init__(self, spec, instance: Instance):
        self.spec = spec
        if instance.kind == "GPU" and instance.device not in devices.visible_gpus():
            raise UnavailableError(
                f"model '{spec.name}' version {spec.version}: instance {instance.index} is on "
                f"GPU {instance.device}, which this machine does not show (visible GPUs: "
                f"{list(devices.visible_gpus()) or 'none: no NVIDIA driver or nvidia-ml-py'})")
        module, imported_pb_utils = import_model(spec.path, f"shmserve_model_{spec.name}_{spec.version}")
        cls = model_class(module, spec.path)
        api = spec.parameters.get(API_PARAMETER, TRITON_API if imported_pb_utils else NUMPY_API)
        if api not in (TRITON_API, NUMPY_API):
            raise ConfigError(f"model '{spec.name}': parameters \"{API_PARAMETER}\" must be "
                              f"\"{TRITON_API}\" or \"{NUMPY_API}\", got {api!r}")
        self.per_request = api == TRITON_API  # the worker calls execute_requests()
        self._loop = None
        bls.bind(spec.name, spec.instance_count, instance.server, instance.socket)  # lazy lease
        logger.bind(f"model '{spec.name}' version {spec.version} instance {instance.index}")
        self.model = cls()
        # numpy-dict models opt in to per-request parameters by naming them
        self.wants_requests = (not self.per_request and
                               "requests" in inspect.signature(self.model.execute).parameters)
        if hasattr(self.model, "initialize"):
            self.model.initialize(initialize_args(spec, instance))
        if self.per_request and inspect.iscoroutinefunction(self.model.execute):
            self._loop = asyncio.new_event_loop()  # one for the worker's life: BLS futures live on it

    # -- the numpy-dict API: the whole batch at once -----------------------------------------
    def execute(self, inputs, requests=None):
        if requests is None:
            return self.model.execute(inputs)
        return self.model.execute(inputs, requests)

    # -- Triton's API: a list of requests, a response each ------------------------------------
    def execute_requests(self, requests) -> list:
        """requests: per request, (its inputs as {name: array view} or (name, array view)
        pairs, its requested output names, its parameters dict). Returns per request
        {output name: array}, or (status, message) for an error."""
        reqs = received(requests)
        if self._loop is not None:
            responses = self._loop.run_until_complete(self.model.execute(reqs))
        else:
            responses = self.model.execute(reqs)
        results = response_arrays(responses, len(reqs))  # per response its arrays, or None
        if results is None:  # not a list (or tuple) of one response per request
            return [(Status.INTERNAL, self._not_one_each(responses, len(reqs)))] * len(reqs)
        if None in results:  # an error, or not a response: the request hears which
            results = [self._refused(i, response) if arrays is None else arrays
                       for i, (arrays, response) in enumerate(zip(results, responses))]
        return results

    def _not_one_each(self, responses, n: int) -> str:
        what = f"{len(responses)} responses" if isinstance(responses, (list, tuple)) \
            else f"a {type(responses).__name__}"
        msg = (f"model '{self.spec.name}': execute() returned {what} for {n} "
               "requests; Triton's python API (the model imports triton_python_backend_utils"
               ") wants a list of one pb_utils.InferenceResponse per request")
        if isinstance(responses, dict):
            msg += (f" (a numpy-dict model sets parameters \"{API_PARAMETER}\" to "
                    f"\"{NUMPY_API}\")")
        return msg

    def execute_decoupled(self, requests: list[tuple]):
        """A decoupled model's execute (server/stream.py): requests as
        execute_requests's, each with its ResponseStream last; the model sends through
        request.get_response_sender(). Returns what execute() returned (None)."""
        reqs = received_with_streams(requests)
        if self._loop is not None:
            return self._loop.run_until_complete(self.model.execute(reqs))
        return self.model.execute(reqs)

    def _refused(self, i: int, response) -> tuple:
        """(status, message) for the response to request i: its error, or why it is none."""
        if type(response) is not _InferenceResponse:
            return (Status.INTERNAL, f"model '{self.spec.name}': execute() returned "
                    f"{type(response).__name__} for request {i}, not a pb_utils.InferenceResponse")
        if response._error is not None:
            return (status_of(response._error), response._error.message())
        wrong = next(t for t in response._outputs if type(t) is not _Tensor)
        return (Status.INTERNAL, f"model '{self.spec.name}': the response to request {i} holds "
                f"a {type(wrong).__name__}, not a pb_utils.Tensor")

    def close(self):
        try:
            if hasattr(self.model, "finalize"):
                self.model.finalize()
        finally:
            bls.close()
            if self._loop is not None:
                self._loop.close()


def initialize_args(spec, instance: Instance) -> dict:
    """initialize(args) as Triton gives it (every value a str), plus "parameters"
    ({key: string_value}) that shmserve's numpy-dict models have always had."""
    cfg = text_format.Parse(spec.config_text, mc.ModelConfig())
    K = mc.ModelInstanceGroup
    if not cfg.instance_group:  # as Triton completes it (server/devices.py planned it)
        gpus = sorted({d for d in spec.devices if d != devices.CPU})
        group = cfg.instance_group.add(count=1 if gpus else spec.instance_count,
                                       kind=K.KIND_GPU if gpus else K.KIND_CPU)
        group.gpus.extend(gpus)
    first, name = 0, ""  # Triton names an instance <group name>_<index in its group>
    for g, group in enumerate(cfg.instance_group):
        group.name = group.name or f"{spec.name}_{g}"
        group.count = group.count or 1
        n = group.count * (len(group.gpus) if group.kind == K.KIND_GPU else 1)
        if first <= instance.index < first + n:
            name = f"{group.name}_{instance.index - first}"
        first += n
    return {
        "model_config": config_json(cfg),
        "model_instance_kind": instance.kind,
        "model_instance_name": name,
        "model_instance_device_id": str(max(instance.device, 0)),
        "model_repository": spec.path.rsplit("/", 2)[0],
        "model_version": str(spec.version),
        "model_name": spec.name,
        "parameters": dict(spec.parameters),
    }
