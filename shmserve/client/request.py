"""A request before it reaches shared memory: what the client knows of a model (its
plan, worked out once), and the caller's inputs and wanted outputs checked against it."""
from __future__ import annotations

import collections.abc

import numpy as np

from .. import errors
from .. import protocol as P

_BYTES = P.DataType.BYTES
_DTYPE_CODE = {np.dtype(t): P.dtype_code(np.dtype(t)) for t in
               (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                np.uint64, np.float16, np.float32, np.float64)}


DEVICE = -2  # sources(): the tensor is in device memory (a gpu.ipc.DeviceSource)


class Plan:
    """What the client needs of one (model, version), worked out once."""

    def __init__(self, meta: dict):
        self.meta = meta
        self.id, self.name, self.version = meta["id"], meta["name"], meta["version"]
        self.batched = meta["max_batch_size"] > 0
        self.input_index = {t["name"]: i for i, t in enumerate(meta["inputs"])}
        self.output_index = {t["name"]: i for i, t in enumerate(meta["outputs"])}
        self.output_names = [t["name"] for t in meta["outputs"]]
        self.outputs = []  # (index, name, itemsize or 0 for BYTES, dims without batch or None)
        for i, t in enumerate(meta["outputs"]):
            dims = t["shape"][1:] if self.batched else t["shape"]
            fixed = t["datatype"] != "BYTES" and all(d >= 0 for d in dims)
            itemsize = 0 if t["datatype"] == "BYTES" else \
                P.numpy_dtype(P.DTYPE_CODES[t["datatype"]]).itemsize
            self.outputs.append((i, t["name"], itemsize, dims if fixed else None))
        self.fast = None  # compiled for the C path (ClientCore.compile), or None


class Request:
    """One request of the Python path (or one submit() sent by the C path), from
    submit to answer. `sources` and `call` keep the caller's inputs so a request can
    be rebuilt (output buffer too small), and alive while the server reads them; the C
    path sets only `call`, and `sources` is worked out from it when needed."""

    __slots__ = ("plan", "sources", "wanted", "copy", "future", "retried", "slot", "generation",
                 "block", "block_bytes", "outputs", "sources_refs", "options", "params_offset",
                 "string_id_offset", "sending",
                 # CUDA IPC (gpu/ipc.py): [(record offset, DeviceSource)] of the inputs,
                 # {output index: (DeviceSource, caller's tensor)} of device outputs
                 "device_records", "destinations",
                 # (model, inputs, outputs, version) as the caller gave them, while the
                 # request may be sent again to a model resolved again (reloaded)
                 "call")


def version_key(version) -> int | None:
    """A model version as the control messages carry it: None for the highest."""
    return int(version) if version not in (None, "", -1, 0) else None


def sources(plan: Plan, inputs, locate) -> list:
    """(index, dtype code, array or encoded bytes, arena offset or -1, shape) per
    input (a device tensor: a gpu.ipc.DeviceSource and DEVICE). locate(array) is the array's offset in the caller's arena, or -1 when it
    is not there (then it is copied in once)."""
    if not isinstance(inputs, collections.abc.Mapping):
        inputs = list(inputs)
        if len(inputs) > len(plan.input_index):
            raise errors.InvalidArgumentError(
                f"model '{plan.name}' takes {len(plan.input_index)} inputs "
                f"({', '.join(plan.input_index)}), got {len(inputs)}")
        inputs = dict(zip(plan.input_index, inputs))
    sources = []
    for name, value in inputs.items():
        index = plan.input_index.get(name)
        if index is None:
            raise errors.InvalidArgumentError(
                f"model '{plan.name}' has no input '{name}' "
                f"(inputs: {', '.join(plan.input_index)})")
        if not isinstance(value, np.ndarray) and hasattr(value, "__cuda_array_interface__"):
            sources.append(_device_source(plan, f"input '{name}'", index, value))
            continue
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        code = _DTYPE_CODE.get(arr.dtype) or _dtype_code(plan, name, arr)
        if code == _BYTES:
            sources.append((index, code, P.encode_bytes(arr), -1, arr.shape))
            continue
        offset = locate(arr)
        if offset < 0 and not arr.flags.c_contiguous:  # the one copy on the way in
            arr = np.ascontiguousarray(arr)
        sources.append((index, code, arr, offset, arr.shape))
    return sources


def _device_source(plan: Plan, what: str, index: int, value) -> tuple:
    """A tensor in device memory, sent by CUDA IPC (gpu/ipc.py): (index, dtype code,
    DeviceSource, DEVICE, shape), as sources() gives the others."""
    from ..gpu import driver, ipc  # libcuda: loaded only when a device tensor is sent
    try:
        src = ipc.DeviceSource(value, f"model '{plan.name}' {what}")
    except (driver.CudaError, ValueError, TypeError, KeyError) as e:
        raise errors.InvalidArgumentError(f"model '{plan.name}' {what}: cannot send this "
                                          f"device tensor ({e})") from None
    code = _DTYPE_CODE.get(src.dtype)
    if code is None:
        raise errors.InvalidArgumentError(f"model '{plan.name}' {what}: device tensors of "
                                          f"{src.dtype} are not supported")
    return index, code, src, DEVICE, src.shape


def destinations(plan: Plan, outputs) -> dict:
    """{output index: DeviceSource} for outputs the caller wants written into its own
    device buffers: outputs={"name": device_tensor, "other": None}."""
    if not isinstance(outputs, collections.abc.Mapping):
        return {}
    found = {}
    for name, value in outputs.items():
        if value is None:
            continue
        if not hasattr(value, "__cuda_array_interface__"):
            raise errors.InvalidArgumentError(
                f"model '{plan.name}' output '{name}': a destination must be a device tensor "
                f"(__cuda_array_interface__: torch, cupy), got {type(value).__name__}; "
                "None lets the server write it into this client's arena")
        index = plan.output_index.get(name)
        if index is not None:
            found[index] = (_device_source(plan, f"output '{name}'", index, value)[2], value)
    return found


def _dtype_code(plan: Plan, name: str, arr: np.ndarray) -> int:
    try:
        return P.dtype_code(arr.dtype)
    except TypeError as e:
        raise errors.InvalidArgumentError(f"model '{plan.name}' input '{name}': {e}") from None


def wanted(plan: Plan, outputs) -> list:
    """The output specs (Plan.outputs entries) a request asks for; default all. A
    mapping names them by its keys (its values: destinations())."""
    if outputs is None:
        return plan.outputs
    if isinstance(outputs, collections.abc.Mapping):
        outputs = list(outputs)
    if isinstance(outputs, str):
        outputs = [outputs]
    wanted = []
    for name in outputs:
        if name not in plan.output_index:
            raise errors.InvalidArgumentError(
                f"model '{plan.name}' has no output '{name}' "
                f"(outputs: {', '.join(plan.output_names)})")
        wanted.append(plan.outputs[plan.output_index[name]])
    return wanted
