"""Tensors in device memory between a caller and a GPU worker, by CUDA IPC
(memory kind CUDA_IPC; docs/protocol.md section "Device memory", docs/gpu.md).

A caller's device tensor travels as a 160-byte record (shms_cuda_ipc) in its arena:
the IPC handle of the allocation holding it, the tensor's offset in that allocation,
the device's UUID, and for an input the IPC handle of an event recorded after the
caller's writes. The worker opens the allocation once per (caller lease, allocation),
checks every range against the allocation's real size, makes its stream wait for the
event, and computes on the caller's memory in place; an output named by a record is
written straight into the caller's device buffer. Nothing in a record is trusted.

Caller side: DeviceSource (from any object with __cuda_array_interface__: torch,
cupy, numba). Worker side: DeviceMemory. Both need libcuda (driver.py) and load it
only when a device tensor shows up.
"""
from __future__ import annotations

import collections
import logging
import struct

import numpy as np

from . import driver as D
from ..protocol import LAYOUT as L

log = logging.getLogger("shmserve.worker")
RECORD = struct.Struct("<64s64sQ16sII")  # shms_cuda_ipc
assert RECORD.size == L["cuda_ipc.size"]
EVENT = 1  # SHMS_CUDA_IPC_EVENT
CU_STREAM_LEGACY = 1  # __cuda_array_interface__'s and the driver's name for it
OPEN_PER_CLIENT = 64  # allocations a worker keeps open per caller before closing the oldest
_NUMPY_OF: dict = {}  # torch dtype -> numpy dtype


class DeviceError(ValueError):
    """A record the worker cannot use (names the tensor in the message)."""


def is_device_tensor(value) -> bool:
    return hasattr(value, "__cuda_array_interface__") and not isinstance(value, np.ndarray)


class DeviceSource:
    """One caller tensor in device memory, described for a request."""

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "ordinal", "stream", "base", "handle", "uuid")

    def __init__(self, value, what: str):
        cai = value.__cuda_array_interface__
        self.shape = tuple(int(d) for d in cai["shape"])
        self.dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _contiguous(self.shape, self.dtype.itemsize):
            raise ValueError(f"{what} is a strided device tensor: pass a contiguous one "
                             "(.contiguous() / cupy.ascontiguousarray)")
        self.ptr = int(cai["data"][0])
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.stream = _producer_stream(value, cai)
        self.ordinal, self.base, self.handle, self.uuid = _exported(self.ptr)

    def record(self, event_handle: bytes | None) -> bytes:
        return RECORD.pack(self.handle, event_handle or bytes(64), self.ptr - self.base,
                           self.uuid, EVENT if event_handle else 0, 0)


_EXPORTS: dict[int, tuple] = {}  # buffer id -> (ordinal, base, IPC handle, device UUID)
EXPORTS_KEPT = 4096


def _exported(ptr: int) -> tuple:
    """(ordinal, allocation base, IPC handle, device UUID) of device memory at ptr.
    Exporting costs driver work (tens of microseconds and more); an allocation's id is
    never reused, so its export is kept by id and looked up with one attribute call."""
    if not ptr:  # an empty tensor: nothing to open
        return 0, 0, bytes(64), bytes(16)
    key = D.buffer_id(ptr)
    got = _EXPORTS.get(key)
    if got is None:
        ordinal = D.pointer_device(ptr)  # CudaError unless device memory
        D.use_device(ordinal)
        base, _ = D.address_range(ptr)
        if len(_EXPORTS) >= EXPORTS_KEPT:
            _EXPORTS.clear()
        got = _EXPORTS[key] = (ordinal, base, D.ipc_mem_handle(base), D.device_uuid(ordinal))
    return got


def _producer_stream(value, cai: dict):
    """The stream whose work wrote the tensor: the interface's (version 3; None: no
    synchronisation needed), torch's current stream for a torch tensor (its interface
    is version 2, without one), else the legacy default stream."""
    if "stream" in cai:
        return cai["stream"]
    if type(value).__module__.startswith("torch"):
        import torch
        return torch.cuda.current_stream(value.device).cuda_stream
    return CU_STREAM_LEGACY


def _contiguous(shape: tuple, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class SlotEvents:
    """The caller's side of ordering: one interprocess event per (slot, device),
    recorded on the producing stream at submission; a slot carries one request at a
    time, so a record is never overwritten before the worker waited on it."""

    def __init__(self):
        self._events: dict[tuple[int, int], tuple[int, bytes]] = {}

    def record(self, slot: int, sources: list[DeviceSource]) -> bytes | None:
        streams = {s.stream for s in sources if s.stream is not None}
        if not streams:
            return None
        *others, last = sorted(streams)
        for stream in others:  # one event per slot marks one stream: finish the others
            D.stream_synchronize(stream)
        ordinal = sources[0].ordinal
        key = (slot, ordinal)
        if key not in self._events:
            D.use_device(ordinal)
            self._events[key] = D.ipc_event()
        event, handle = self._events[key]
        D.event_record(event, last)
        return handle

    @staticmethod
    def settle(sources: list[DeviceSource]) -> None:
        """Output buffers of a request without device inputs: the work their streams
        have queued (which may still use them) finishes before the server writes them."""
        for stream in {s.stream for s in sources if s.stream is not None}:
            D.stream_synchronize(stream)

    def close(self) -> None:
        for event, _ in self._events.values():
            try:
                D.event_destroy(event)
            except D.CudaError:
                pass
        self._events.clear()


class _CudaArray:
    """A device pointer as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, shape: tuple, dtype: np.dtype):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": dtype.str,
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


class DeviceMemory:
    """A GPU worker's view of its callers' device memory: allocations opened per
    caller lease (closed when the lease ends or past OPEN_PER_CLIENT), events opened
    per caller, tensors as torch tensors on the worker's device (ordinal 0: a GPU
    worker sees only its GPU)."""

    def __init__(self, torch):
        self.torch = torch
        D.use_device(0)
        self.uuid = D.device_uuid(0)
        self._open: dict[tuple[int, int], collections.OrderedDict] = {}  # lease -> handle: (base, size)
        self._events: dict[tuple[int, int], dict[bytes, int]] = {}

    def _record(self, arena_buf, offset: int, what: str):
        handle, event, inner, uuid, flags, _ = RECORD.unpack_from(arena_buf, offset)
        if uuid != self.uuid:
            raise DeviceError(f"{what} is on GPU {_uuid_text(uuid)}, this instance runs on GPU "
                              f"{_uuid_text(self.uuid)}")
        return handle, event, inner, flags

    def _allocation(self, lease: tuple[int, int], handle: bytes, what: str) -> tuple[int, int]:
        opened = self._open.setdefault(lease, collections.OrderedDict())
        got = opened.get(handle)
        if got is None:
            try:
                base = D.ipc_open_mem(handle)
            except D.CudaError as e:
                raise DeviceError(f"{what}: cannot open its CUDA IPC handle ({e})") from None
            got = opened[handle] = (base, D.address_range(base)[1])
        opened.move_to_end(handle)
        return got

    def tensor(self, arena_buf, lease: tuple[int, int], ref, dtype: np.dtype, shape, what: str,
               is_input: bool):
        """The tensor a ref names, in place in the caller's device memory. An input
        waits (on the worker's stream) for the caller's event."""
        handle, event, inner, flags = self._record(arena_buf, ref[2], what)
        base, size = self._allocation(lease, handle, what)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if inner > size or nbytes > size - inner or (not is_input and nbytes > ref[3]):
            raise DeviceError(f"{what}: [{inner}, +{nbytes}) is outside its device allocation of "
                              f"{size} bytes" + ("" if is_input else f" or its buffer of {ref[3]}"))
        if is_input and flags & EVENT:
            D.stream_wait_event(self.torch.cuda.current_stream().cuda_stream,
                                self._event(lease, event, what))
        return self.torch.as_tensor(_CudaArray(base + inner, shape, dtype), device="cuda")

    def _event(self, lease: tuple[int, int], handle: bytes, what: str) -> int:
        events = self._events.setdefault(lease, {})
        if handle not in events:
            try:
                events[handle] = D.ipc_open_event(handle)
            except D.CudaError as e:
                raise DeviceError(f"{what}: cannot open its CUDA IPC event ({e})") from None
        return events[handle]

    # -- the worker's batch with device tensors in it (server/worker.py) ---------------
    def is_tensor(self, value) -> bool:
        return isinstance(value, self.torch.Tensor)

    def numpy_dtype(self, tensor) -> np.dtype:
        got = _NUMPY_OF.get(tensor.dtype)
        if got is None:
            got = _NUMPY_OF[tensor.dtype] = self.torch.empty(0, dtype=tensor.dtype).numpy().dtype
        return got

    def as_device(self, value):
        """A batch part on the device: host arrays (arena views: pinned) copied once."""
        if isinstance(value, self.torch.Tensor):
            return value
        return self.torch.from_numpy(np.ascontiguousarray(value)).to("cuda", non_blocking=True)

    def cat(self, parts: list):
        """Several requests' parts of one input, gathered on the device."""
        return self.torch.cat([self.as_device(p) for p in parts])

    def to_host(self, dst: np.ndarray, tensor) -> None:
        """A device output into a caller's arena (page-locked: one DMA, no staging)."""
        self.torch.from_numpy(dst).copy_(tensor)

    def synchronize(self) -> None:
        """Before the answers go out: the worker's device work on callers' memory is
        done; then the open allocations are trimmed."""
        self.torch.cuda.current_stream().synchronize()
        self.trim()

    def trim(self) -> None:
        """Between batches: each caller keeps its OPEN_PER_CLIENT latest allocations."""
        for opened in self._open.values():
            while len(opened) > OPEN_PER_CLIENT:
                base, _ = opened.popitem(last=False)[1]
                D.ipc_close_mem(base)

    def drop(self, live_leases: set) -> None:
        """Closes what callers whose lease ended had opened (between batches)."""
        for lease in [k for k in self._open if k not in live_leases]:
            opened = self._open.pop(lease)
            for base, _ in opened.values():
                D.ipc_close_mem(base)
            if opened:
                log.info("client %d (lease %d) is gone: closed its %d device allocation(s), "
                         "%d MiB", *lease, len(opened), sum(n for _, n in opened.values()) >> 20)
        for lease in [k for k in self._events if k not in live_leases]:
            for event in self._events.pop(lease).values():
                D.event_destroy(event)

    def opened(self) -> int:
        return sum(len(o) for o in self._open.values())


def _uuid_text(uuid: bytes) -> str:
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class HostPinning:
    """Page-locks the callers' arenas in a GPU worker (cuMemHostRegister), so that
    copies between an arena and the device run at pinned-memory speed, straight from
    and into the caller's bytes (no staging buffer). One registration per mapping, made
    when the worker maps a caller's arena and undone before it unmaps it."""

    def __init__(self, ordinal: int = 0):
        D.use_device(ordinal)
        self._registered: dict[int, int] = {}  # id(segment) -> address

    def register(self, seg) -> None:
        address = np.frombuffer(seg.buffer, np.uint8).ctypes.data
        D.host_register(address, seg.size)
        self._registered[id(seg)] = address

    def unregister(self, seg) -> None:
        address = self._registered.pop(id(seg), None)
        if address is not None:
            D.host_unregister(address)
