"""The few CUDA driver API calls the GPU path needs, through ctypes on libcuda.

Why the driver API and not a framework: a caller's device tensor may come from torch,
cupy or any library that speaks `__cuda_array_interface__`, and a worker may run torch,
onnxruntime or TensorRT; libcuda is the one library all of them share (it comes with
the driver, so a machine with a GPU has it). Nothing here loads until a GPU path asks:
CPU-only machines never import libcuda.

Every call raises CudaError naming the call and the driver's message.
"""
from __future__ import annotations

import ctypes
import threading

CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEMORYTYPE_DEVICE = 2
HANDLE_BYTES = 64  # CUipcMemHandle and CUipcEventHandle: opaque, 64 bytes each


class CudaError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char array field reads back as a string, cut at its first
    # NUL byte, and handles are binary
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


def handle_of(data: bytes) -> _Handle:
    """The driver's handle struct holding these 64 bytes (passed by value)."""
    if len(data) != HANDLE_BYTES:
        raise CudaError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(data)}")
    return _Handle.from_buffer_copy(data)


def handle_bytes(handle: _Handle) -> bytes:
    return bytes(handle.reserved)


_lib = None
_lock = threading.Lock()


def lib():
    """libcuda, initialised once; CudaError where there is no driver."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    cuda = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise CudaError(f"no CUDA driver on this machine (libcuda.so.1: {e})") from None
                _check(cuda, "cuInit", cuda.cuInit(0))
                _lib = cuda
    return _lib


def _check(cuda, name: str, result: int) -> None:
    if result:
        text = ctypes.c_char_p()
        cuda.cuGetErrorString(result, ctypes.byref(text))
        raise CudaError(f"{name} failed: {text.value.decode() if text.value else 'error'} "
                        f"(CUresult {result})")


def call(name: str, *args) -> None:
    cuda = lib()
    _check(cuda, name, getattr(cuda, name)(*args))


def use_device(ordinal: int) -> None:
    """Makes the device's primary context (the one torch, cupy and the runtime API use)
    current on this thread: driver calls act in the current context."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", ctypes.byref(dev), ordinal)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)


def device_count() -> int:
    n = ctypes.c_int()
    call("cuDeviceGetCount", ctypes.byref(n))
    return n.value


def device_uuid(ordinal: int) -> bytes:
    dev, uuid = ctypes.c_int(), (ctypes.c_ubyte * 16)()
    call("cuDeviceGet", ctypes.byref(dev), ordinal)
    call("cuDeviceGetUuid", uuid, dev)
    return bytes(uuid)


def pointer_device(ptr: int) -> int:
    """The ordinal of the device that holds ptr; CudaError if ptr is not device memory."""
    kind, ordinal = ctypes.c_uint(), ctypes.c_int()
    call("cuPointerGetAttribute", ctypes.byref(kind), CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
         ctypes.c_uint64(ptr))
    if kind.value != CU_MEMORYTYPE_DEVICE:
        raise CudaError(f"pointer {ptr:#x} is not device memory (CUmemorytype {kind.value})")
    call("cuPointerGetAttribute", ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
         ctypes.c_uint64(ptr))
    return ordinal.value


def buffer_id(ptr: int) -> int:
    """The allocation's process-wide unique id (never reused, unlike its address)."""
    got = ctypes.c_uint64()
    call("cuPointerGetAttribute", ctypes.byref(got), CU_POINTER_ATTRIBUTE_BUFFER_ID,
         ctypes.c_uint64(ptr))
    return got.value


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation that holds ptr."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    return base.value, size.value


def ipc_mem_handle(base: int) -> bytes:
    handle = _Handle()
    call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(base))
    return handle_bytes(handle)


def ipc_open_mem(handle: bytes) -> int:
    """Maps another process's allocation into this one (its base address)."""
    ptr = ctypes.c_uint64()
    call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), handle_of(handle),
         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return ptr.value


def ipc_close_mem(ptr: int) -> None:
    call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))


def ipc_event() -> tuple[int, bytes]:
    """A new event that other processes can wait on: (CUevent, its IPC handle)."""
    event, handle = ctypes.c_void_p(), _Handle()
    call("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)
    call("cuIpcGetEventHandle", ctypes.byref(handle), event)
    return event.value, handle_bytes(handle)


def ipc_open_event(handle: bytes) -> int:
    event = ctypes.c_void_p()
    call("cuIpcOpenEventHandle", ctypes.byref(event), handle_of(handle))
    return event.value


def event_record(event: int, stream: int) -> None:
    call("cuEventRecord", ctypes.c_void_p(event), ctypes.c_void_p(stream))


def event_destroy(event: int) -> None:
    call("cuEventDestroy_v2", ctypes.c_void_p(event))


def stream_wait_event(stream: int, event: int) -> None:
    call("cuStreamWaitEvent", ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)


def stream_synchronize(stream: int) -> None:
    call("cuStreamSynchronize", ctypes.c_void_p(stream))


def host_register(address: int, nbytes: int) -> None:
    """Page-locks host memory already mapped (a client's arena) for DMA, in every context."""
    call("cuMemHostRegister_v2", ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
         CU_MEMHOSTREGISTER_PORTABLE)


def host_unregister(address: int) -> None:
    call("cuMemHostUnregister", ctypes.c_void_p(address))


def memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    call("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_uint64(src),
         ctypes.c_size_t(nbytes), ctypes.c_void_p(stream))


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value
