"""The control socket: frames (a 4-byte big-endian length, then one msgpack map) and
the operations a client may ask for."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import socket
import struct
import typing
from typing import ClassVar

import msgpack
# A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
# "op"; replies carry "ok" and either the answer's fields or "code", "error", "type".
FRAME_HEADER = struct.Struct(">I")
# A request whose model handle an unload or reload made stale is refused UNAVAILABLE
# with a message that carries this (docs/protocol.md, "Model handles"): the model name
# must be resolved again. Clients look for it to re-resolve.
STALE_MODEL_ID = "stale model id"
# Triton's refusal of load and unload outside --model-control-mode explicit.
MODEL_CONTROL_DISABLED = "explicit model load / unload is not allowed if polling is enabled"
MAX_FRAME_BYTES = 16 << 20


# ---------------------------------------------------------------- messages
# Every control message, declared once: the client and the coordinator build and read
# these, never raw dicts. docs/protocol.md section 2 is the prose; the C++ client's
# codec (clients/cpp/include/shmserve/wire.hpp) is checked against the same test
# vectors (tests/vectors/protocol_vectors.json).

@functools.cache
def _field_types(cls) -> dict:
    """A message class's field types, resolved once (annotations are strings here)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass
class Message:
    """A control message; subclasses list their fields with types, checked on decode."""

    OP: ClassVar[str | None] = None  # requests only: the "op" that names them

    def to_wire(self) -> dict:
        fields = dataclasses.asdict(self)
        return {"op": self.OP, **fields} if self.OP else {"ok": True, **fields}

    @classmethod
    def from_wire(cls, wire: dict):
        """The message of a decoded frame; unknown keys are ignored (a newer peer may
        add fields), a missing or mistyped field raises ValueError naming it."""
        hints = _field_types(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in wire:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ValueError(f"{cls.__name__}: field '{f.name}' is missing")
                continue
            value = wire[f.name]
            allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
            allowed = tuple(typing.get_origin(t) or t for t in allowed)
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                names = " or ".join("nil" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{cls.__name__}: field '{f.name}' must be {names}, "
                                 f"got {type(value).__name__}")
            values[f.name] = value
        return cls(**values)


# -- requests (client -> coordinator)

@dataclasses.dataclass
class Hello(Message):
    """Opens the lease; the reply carries the arena's and control segment's memfds."""

    OP: ClassVar[str] = "hello"
    version: int | None = None  # the coordinator answers a missing or other version
    pid: int = 0  # informative: the server takes the caller's pid from SO_PEERCRED
    arena_bytes: int = 0  # 0: the server's default


@dataclasses.dataclass
class ListModels(Message):
    OP: ClassVar[str] = "models"


@dataclasses.dataclass
class GetMetadata(Message):
    OP: ClassVar[str] = "metadata"
    model: str
    version: int | None = None  # None: the highest


@dataclasses.dataclass
class GetConfig(Message):
    OP: ClassVar[str] = "config"
    model: str
    version: int | None = None


@dataclasses.dataclass
class GetLabels(Message):
    """The labels of a model version's outputs that name a label_filename (Triton's
    classification extension: the fronts add them to the top-k classes)."""
    OP: ClassVar[str] = "labels"
    model: str
    version: int | None = None


@dataclasses.dataclass
class LogSettings(Message):
    """Triton's logging extension: the log settings, after applying `update` (Triton's
    setting names to values) to every process of the server when given."""
    OP: ClassVar[str] = "log_settings"
    update: dict | None = None


@dataclasses.dataclass
class TraceSettings(Message):
    """Triton's trace extension: the trace settings (global; `model` only checks that
    the model exists), after applying `update` when given."""
    OP: ClassVar[str] = "trace_settings"
    model: str | None = None
    update: dict | None = None


@dataclasses.dataclass
class GetStats(Message):
    """Triton's statistics extension: every model, every version of `model`, or one."""
    OP: ClassVar[str] = "stats"
    model: str | None = None  # None: every model
    version: int | None = None
    histograms: bool = False  # add each duration's latency histogram (sparse)


@dataclasses.dataclass
class GetStatus(Message):
    """The server at a glance (`shmserve status`, the metrics endpoint): every model's
    statistics with histograms, instances, clients, ring depth, batcher."""
    OP: ClassVar[str] = "status"


@dataclasses.dataclass
class LoadModel(Message):
    """Triton's repository extension, load: loads a model (every version its
    version_policy selects), or reloads a loaded one. `config`: the model
    configuration as JSON, used instead of config.pbtxt (Triton's `config`). `files`:
    path in the model directory -> bytes (Triton's `file:<path>` parameters): the model
    is made of these files and `config`, not taken from the repository."""
    OP: ClassVar[str] = "load"
    model: str
    config: str | None = None
    files: dict | None = None


@dataclasses.dataclass
class UnloadModel(Message):
    """Unloads every version of a model: requests it holds finish, new ones are
    refused (UNAVAILABLE, naming the model), then its workers stop.
    `unload_dependents`: the ensembles calling it are unloaded too (Triton's)."""
    OP: ClassVar[str] = "unload"
    model: str
    unload_dependents: bool = False


@dataclasses.dataclass
class RepositoryIndex(Message):
    """Triton's repository index: every model of the repository and of the table."""
    OP: ClassVar[str] = "index"
    ready: bool = False  # only the READY versions


@dataclasses.dataclass
class ShmRegister(Message):
    """Triton's system shared memory extension: registers `byte_size` bytes at `offset`
    of the POSIX shared memory object `key` (/dev/shm/<key>) as region `name`, for
    every front of the server (shmserve/server/system_shm.py)."""
    OP: ClassVar[str] = "shm_register"
    name: str
    key: str
    offset: int
    byte_size: int


@dataclasses.dataclass
class ShmStatus(Message):
    """The registered system shared memory regions (all, or the one named)."""
    OP: ClassVar[str] = "shm_status"
    name: str | None = None  # None: every region; an unknown name: NOT_FOUND


@dataclasses.dataclass
class ShmUnregister(Message):
    OP: ClassVar[str] = "shm_unregister"
    name: str | None = None  # None: every region; an unknown name is no error (Triton)


REQUESTS: dict[str, type[Message]] = {c.OP: c for c in (Hello, ListModels, GetMetadata,
                                                         GetConfig, GetStats, GetStatus)}
REQUESTS.update({c.OP: c for c in (ShmRegister, ShmStatus, ShmUnregister)})
REQUESTS.update({c.OP: c for c in (LoadModel, UnloadModel, RepositoryIndex, GetLabels)})
REQUESTS.update({c.OP: c for c in (LogSettings, TraceSettings)})
OP_HELLO, OP_MODELS, OP_METADATA, OP_CONFIG, OP_STATS, OP_STATUS = (
    Hello.OP, ListModels.OP, GetMetadata.OP, GetConfig.OP, GetStats.OP, GetStatus.OP)


# -- replies (coordinator -> client)

@dataclasses.dataclass
class ModelMetadata(Message):
    """KServe-v2-style metadata, plus what a shared-memory client needs (id)."""

    id: int
    name: str
    version: int
    platform: str
    max_batch_size: int
    inputs: list  # [{name, datatype, shape}], shape with -1 for the batch and any size
    outputs: list
    state: str = "LOADING"  # READY, or UNAVAILABLE: <reason>
    decoupled: bool = False  # model_transaction_policy decoupled: answers stream requests only


@dataclasses.dataclass
class HelloReply(Message):
    client_id: int
    generation: int
    control_bytes: int
    bell_bytes: int
    arena_bytes: int
    slots_offset: int
    n_slots: int
    data_offset: int
    server_pid: int
    spin_us: int
    models: list  # [ModelMetadata as a map]


@dataclasses.dataclass
class ModelList(Message):
    models: list  # [ModelMetadata as a map]
    # The server's readiness (Triton's /v2/health/ready) under its --strict-readiness;
    # None: a server that does not say (then ready = every model READY).
    ready: bool | None = None


@dataclasses.dataclass
class ModelConfig(Message):
    config: str  # config.pbtxt as parsed (protobuf text format)


@dataclasses.dataclass
class LabelsReply(Message):
    id: int  # the model version's handle (ModelMetadata.id): a reload gives a new one
    labels: dict  # {output name: [label, ...]}, only outputs with a label_filename


@dataclasses.dataclass
class SettingsReply(Message):
    settings: dict  # Triton's names: log settings typed, trace settings as lists of str


@dataclasses.dataclass
class StatsReply(Message):
    model_stats: list  # [model_stat of Triton's statistics extension + "shmserve"]


@dataclasses.dataclass
class StatusReply(Message):
    status: dict  # Coordinator.server_status(histograms=True), docs/operating.md


@dataclasses.dataclass
class Done(Message):
    """The answer of a control operation that answers nothing but its success."""


@dataclasses.dataclass
class IndexReply(Message):
    models: list  # [{name, version, state, reason}], version "" and state "" if never loaded


@dataclasses.dataclass
class ErrorReply(Message):
    """A failed request: a status (protocol Status), the message, and the exception
    class name where it is finer than the status (ConfigError, ShmSpaceError...)."""

    code: int
    error: str
    type: str | None = None

    def to_wire(self) -> dict:
        wire = {"ok": False, "code": self.code, "error": self.error}
        return wire if self.type is None else {**wire, "type": self.type}


@dataclasses.dataclass
class ShmRegions(Message):
    """The answer to every system shared memory request: the regions registered after
    it (those asked for), and the registry's generation, which changes with every
    registration and unregistration. A front maps a region through `path` (the
    coordinator's descriptor of it, /proc/<pid>/fd/<n>) and checks that it opened the
    file (`dev`, `ino`) the coordinator registered."""
    regions: list  # [{name, key, offset, byte_size, path, dev, ino}]
    generation: int
    generation_path: str  # the page whose first u64 is the generation (fronts map it)


REPLIES: dict[type[Message], type[Message]] = {
    Hello: HelloReply, ListModels: ModelList, GetMetadata: ModelMetadata,
    GetConfig: ModelConfig, GetStats: StatsReply, GetStatus: StatusReply,
    ShmRegister: ShmRegions, ShmStatus: ShmRegions, ShmUnregister: ShmRegions,
    LoadModel: Done, UnloadModel: Done, RepositoryIndex: IndexReply, GetLabels: LabelsReply,
    LogSettings: SettingsReply, TraceSettings: SettingsReply}


class UnknownOperation(ValueError):
    """A request whose "op" no message declares."""


class TruncatedDescriptors(Exception):
    """The kernel cut off the descriptors sent with a frame (MSG_CTRUNC): the process
    is at its open-file limit, or passed too small a control buffer."""


def decode_request(wire: dict) -> Message:
    """The request of a decoded frame. ValueError (the reply's code 1, malformed) for a
    field of the wrong type, "op" included (msgpack bin is not str), or a missing one;
    UnknownOperation for an "op" no message declares."""
    op = wire.get("op")
    if op is not None and not isinstance(op, str):
        raise ValueError(f"field 'op' must be str, got {type(op).__name__}")
    if op not in REQUESTS:
        raise UnknownOperation(f"unknown control operation {op!r}")
    return REQUESTS[op].from_wire(wire)


def decode_reply(request: Message, wire: dict) -> Message:
    """The reply to `request`: its typed answer, or an ErrorReply."""
    if not wire.get("ok"):
        return ErrorReply.from_wire({"code": 5, "error": "?", **wire})
    return REPLIES[type(request)].from_wire(wire)


def pack_frame(message) -> bytes:
    """A frame of a Message (or of a plain map: test vectors, hostile peers)."""
    if isinstance(message, Message):
        message = message.to_wire()
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:  # the peer would drop the connection: say why here
        raise ValueError(f"control message '{message.get('op')}' of {len(body)} bytes exceeds "
                         f"the control protocol's {MAX_FRAME_BYTES} bytes a frame")
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
    the descriptors. A short read of the header is read on; the descriptors come with
    whichever read returns the frame's first byte. TruncatedDescriptors (what was
    received closed) if the kernel cut them off."""
    header, fds = b"", []
    while len(header) < FRAME_HEADER.size:
        if max_fds:
            data, got, flags, _ = socket.recv_fds(sock, FRAME_HEADER.size - len(header),
                                                  max_fds, socket.MSG_CMSG_CLOEXEC)
            fds += got
            if flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise TruncatedDescriptors(
                    f"the descriptors sent with the reply were cut off (MSG_CTRUNC; {len(fds)} "
                    f"received): this process is probably at its open-file limit (ulimit -n)")
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



async def read_frame(reader: asyncio.StreamReader) -> dict:
    """One frame from an asyncio stream (the coordinator's side). Raises
    asyncio.IncompleteReadError at end of stream, ConnectionError for a frame too long
    to read (the stream cannot go on), ValueError for a body that is no msgpack map."""
    (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return unpack_body(await reader.readexactly(length))
