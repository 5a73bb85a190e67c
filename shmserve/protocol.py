"""Protocol constants and the control-socket codec, shared by every process role.

The shared-memory layout is defined once, in csrc/shmserve.h; LAYOUT below is read
from the compiled extension, never written by hand. docs/protocol.md is the prose.
"""
from __future__ import annotations

import enum
import math
import os
import socket
import struct

import msgpack
import numpy as np

from . import _core

LAYOUT: dict[str, int] = _core.layout()
now_ns = _core.now_ns  # CLOCK_MONOTONIC, the clock of every timestamp in a slot
PROTOCOL_VERSION = LAYOUT["PROTOCOL_VERSION"]
MAX_TENSORS = LAYOUT["MAX_TENSORS"]
MAX_DIMS = LAYOUT["MAX_DIMS"]
NAME_BYTES = LAYOUT["NAME_BYTES"]
DATA_ALIGN = LAYOUT["DATA_ALIGN"]
MAX_BATCH_REQUESTS = LAYOUT["MAX_BATCH_REQUESTS"]
SLOT_BYTES = LAYOUT["slot.size"]


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARG = 1
    NOT_FOUND = 2
    UNAVAILABLE = 3
    OUTPUT_TOO_SMALL = 4
    INTERNAL = 5
    BUSY = 6
    BAD_DESCRIPTOR = 7


class SlotState(enum.IntEnum):
    FREE = 0
    SUBMITTED = 1
    QUEUED = 2
    RUNNING = 3
    DONE = 4


class ServerState(enum.IntEnum):
    STARTING = 0
    READY = 1
    STOPPED = 2


class ClientState(enum.IntEnum):
    FREE = 0
    ALIVE = 1
    DEAD = 2


class Timestamp(enum.IntEnum):
    CLIENT_WRITE = 0
    ENQUEUE = 1
    DEQUEUE = 2
    BATCHED = 3
    COMPUTE_START = 4
    COMPUTE_END = 5
    COMPLETE = 6
    CLIENT_WAKE = 7


class RingResult(enum.IntEnum):
    OK = 0
    FULL = 1
    RECLAIMED = 2


POP_OK, POP_STALLED, POP_CORRUPT = 1, 2, 3  # shms_pop_result (EMPTY comes back as None)


class Ring:
    """This process's view of the request ring: offset and capacity are checked once,
    at attach, and never re-read from the client-writable header (shms_ring)."""

    def __init__(self, ctl_ops):
        self.ops = ctl_ops
        self.offset, self.capacity = ctl_ops.ring_attach()

    def push(self, owner: int, slot: int, generation: int) -> int:
        return self.ops.ring_push(self.offset, self.capacity, owner, slot, generation)


class RingConsumer(Ring):
    """The batcher's side: `pos`, the next position to take, is private to it."""

    def __init__(self, ctl_ops, pos: int):
        super().__init__(ctl_ops)
        self.pos = pos

    def pop(self):
        """None (empty), or (POP_OK, client, slot, generation), (POP_STALLED, owner,
        head_seq, 0), (POP_CORRUPT, 0, head_seq, 0)."""
        got = self.ops.ring_pop(self.offset, self.capacity, self.pos)
        if got is not None and got[0] == POP_OK:
            self.pos += 1
        return got

    def skip(self, head_seq: int) -> bool:
        if self.ops.ring_skip(self.offset, self.capacity, self.pos, head_seq):
            self.pos += 1
            return True
        return False

    def repair(self) -> bool:
        return self.ops.ring_repair(self.offset, self.capacity, self.pos)

    def pending(self) -> list[tuple[int, int, int]]:
        return self.ops.ring_pending(self.offset, self.capacity, self.pos)


# ---------------------------------------------------------------- data types
# Triton's DataType numbers; the names are Triton's without the TYPE_ prefix.
DTYPE_CODES = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7,
    "INT32": 8, "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
try:  # BF16 exists in numpy only through ml_dtypes
    import ml_dtypes

    _NUMPY["BF16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    pass


def numpy_dtype(code: int) -> np.dtype:
    name = DTYPE_NAMES.get(code)
    if name not in _NUMPY:
        raise TypeError(f"data type {name or code} has no numpy equivalent here"
                        + (" (install ml_dtypes for BF16)" if name == "BF16" else ""))
    return _NUMPY[name]


def dtype_code(dtype: np.dtype) -> int:
    """Protocol code of a numpy dtype; str/bytes/object arrays are BYTES."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return DTYPE_CODES["BYTES"]
    for name, nd in _NUMPY.items():
        if nd == dtype and name != "BYTES":
            return DTYPE_CODES[name]
    raise TypeError(f"numpy dtype {dtype} has no shmserve data type")


# BYTES tensors: each element is a 4-byte little-endian length then the bytes.
def encode_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        b = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_bytes(buf, shape) -> np.ndarray:
    """Parses a BYTES buffer; raises ValueError on any length that runs past it."""
    mv = memoryview(buf)
    count = math.prod(int(d) for d in shape)
    if count < 0 or 4 * count > len(mv):  # every element needs its 4-byte length
        raise ValueError(f"BYTES tensor of shape {list(shape)} needs at least {4 * count} "
                         f"bytes, has {len(mv)}")
    out = np.empty(count, dtype=object)
    pos, end = 0, len(mv)
    for i in range(count):
        if pos + 4 > end:
            raise ValueError(f"BYTES tensor truncated at element {i} of {count}")
        (n,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        if n > end - pos:
            raise ValueError(f"BYTES element {i} claims {n} bytes, {end - pos} left")
        out[i] = bytes(mv[pos:pos + n])
        pos += n
    if pos != end:
        raise ValueError(f"BYTES tensor has {end - pos} bytes after its {count} elements")
    return out.reshape(shape)


# ---------------------------------------------------------------- control socket
# A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
# "op"; replies carry "ok" and either the answer or "code" and "error".
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 << 20

OP_HELLO = "hello"        # {version, pid, arena_bytes} -> lease, control name; arena memfd attached
OP_MODELS = "models"      # {} -> {models: [metadata...]}
OP_METADATA = "metadata"  # {model, version?} -> metadata
OP_CONFIG = "config"      # {model, version?} -> {config: text}
OP_STATS = "stats"        # {model?} -> {models: [{name, version, ...counters}]}


def pack_frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME_HEADER.pack(len(body)) + body


def unpack_body(body: bytes) -> dict:
    message = msgpack.unpackb(body, raw=False)
    if not isinstance(message, dict):
        raise ValueError("control frame is not a map")
    return message


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Reads exactly n bytes from a stream socket (a short read is not a frame)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("control socket closed by the peer")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    return recv_frame_fds(sock, 0)[0]


def recv_frame_fds(sock: socket.socket, max_fds: int = 1) -> tuple[dict, list[int]]:
    """A frame and the descriptors sent with it (SCM_RIGHTS on its first bytes: the
    hello reply carries the arena's and the control segment's memfds). The caller owns
    the descriptors."""
    header, fds = b"", []
    while len(header) < FRAME_HEADER.size:
        if max_fds:
            data, got, _, _ = socket.recv_fds(sock, FRAME_HEADER.size - len(header), max_fds,
                                              socket.MSG_CMSG_CLOEXEC)
            fds += got
        else:
            data = sock.recv(FRAME_HEADER.size - len(header))
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("control socket closed by the peer")
        header += data
    (length,) = FRAME_HEADER.unpack(header)
    try:
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        return unpack_body(recv_exact(sock, length)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
