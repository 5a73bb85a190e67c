"""The client engine: one lease on a server (control socket, the mapped control
segment and arena, slots) and the life of each request in it. It writes requests
into its own arena, pushes them on the ring and waits on a futex for the answer; the
slot procedures themselves are the C core's (shms_slot.h). Client (client.py) is the
facade callers use.

Two paths, one lease. The common path of infer() and of submit()'s send is one call
into the C core (ClientCore, csrc/client.c): plan, inputs, slot, push, wait, outputs.
Everything else takes the Python path below, the reference for rare cases and for
every error message: inputs the C path does not take (BYTES, lists, non-contiguous
arrays, unknown names, a model the hello reply did not list, until its metadata came),
answers it does not finish (errors, OUTPUT_TOO_SMALL, BYTES outputs), and the futures'
poller. Both share the C core's slot table, arena allocator and spin policy
(docs/architecture.md, "The Python client").
"""
from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import threading
import time

import numpy as np

from .. import errors
from .. import _core
from .. import protocol as P
from .._core import ClientCore
from ..protocol import LAYOUT as L
from ..segments import DEFAULT_NAME, Segment, pid_alive, socket_path
from .arena import ArenaAllocator, ArenaFull
from .future import ResultFuture
from .request import (_DTYPE_CODE, DEVICE, Plan, Request, destinations, sources, version_key,
                      wanted)
from .result import InferResult
from .stream import EMPTY, ResponseStream

RECORD_BYTES = L["cuda_ipc.size"]  # a device tensor's CUDA IPC record in the arena
CUDA_IPC = int(P.MemoryKind.CUDA_IPC)

_BYTES = P.DataType.BYTES
WAIT_SLICE_NS = 50_000_000  # between liveness checks of the server while waiting
SPIN_US = 100  # a caller spins at least this long for its answer before it sleeps
MAX_SPIN_US = 1000  # ... and up to this long when its answers usually take that long
# The futures' poller outlives its last future this long, so that a caller submitting
# one request after another (a network front at concurrency 1) does not start a thread
# for each (about 200 us on a small machine) and wait for its start.
POLLER_IDLE_NS = 2_000_000_000


def DeviceSourceType():
    """gpu.ipc.DeviceSource where that module was loaded (a device tensor was sent)."""
    mod = sys.modules.get("shmserve.gpu.ipc")
    return mod.DeviceSource if mod is not None else None


def _written(destinations: dict, index: int, shape: tuple, model: str):
    """A device output, written by the server into the caller's own tensor."""
    src, tensor = destinations[index]
    count = int(np.prod(shape, dtype=np.int64))
    if count * src.dtype.itemsize > src.nbytes:
        raise errors.BadDescriptorError(f"model '{model}': server answered with an output "
                                        "larger than the device buffer it was given")
    return tensor if tuple(tensor.shape) == tuple(shape) else \
        tensor.reshape(-1)[:count].reshape(shape)


def _aligned(n: int) -> int:
    return (max(n, 1) + P.DATA_ALIGN - 1) // P.DATA_ALIGN * P.DATA_ALIGN


def _input_dtypes() -> tuple:
    """(dtype, code) for the dtypes the C path sends as they are: numpy's own dtype
    objects, compared by identity (equal dtypes that are other objects, such as
    byte-swapped ones, take the Python path)."""
    types = [np.dtype(np.longlong), np.dtype(np.ulonglong), *_DTYPE_CODE]
    if "BF16" in P._NUMPY:
        types.append(P._NUMPY["BF16"])
    return tuple((t, P.dtype_code(t)) for t in types)


# What the C core builds results from: numpy.ndarray, the result type, the errors it
# raises itself, the input dtypes it takes, the numpy dtype of each output data type
# code (None: BYTES, decoded by Python).
_C_TYPES = (np.ndarray, InferResult, errors.ServerTimeoutError, errors.ServerDeadError,
            _input_dtypes(),
            tuple(None if t in (P.DataType.BYTES, P.DataType.INVALID)
                  else P._NUMPY.get(P.DTYPE_NAMES.get(t)) for t in range(len(P.DataType))))


class Engine:
    """A lease on a running server and the life of its requests: infer() runs one and
    submit() sends one (the C path, else start(): the Python path), wait() (or the
    poller thread, for futures) reads a Python-path answer. Thread-safe. Facades
    (Client, and the network fronts to come) build on it; parameters as Client's."""

    def __init__(self, name: str = DEFAULT_NAME, *, socket_path_: str | None = None,
                 arena_bytes: int | None = None, spin_us: int | None = None):
        self.name = name
        path = socket_path_ or str(socket_path(name, create=False))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise errors.ServerDeadError(
                f"no shmserve server named '{name}' is running (control socket {path}: "
                f"{e.strerror}); start one with `shmserve serve`") from None
        self._sock_lock = threading.Lock()
        try:
            hello, fds = self.call(P.Hello(P.PROTOCOL_VERSION, os.getpid(), arena_bytes or 0),
                                   _fds=3)
        except BaseException:
            self._sock.close()  # no lease: the server ends it with the connection
            raise
        self.client_id = hello.client_id
        self.server_pid = hello.server_pid
        self._spin_ns = int((SPIN_US if spin_us is None else spin_us) * 1000)
        try:  # the arena's, the control block's and the bell's sealed memfds came with it
            if len(fds) != 3:
                raise errors.ShmServeError(f"hello reply carried {len(fds)} descriptors, not 3 "
                                           "(arena, control, bell)", P.Status.INTERNAL)
            self._arena = Segment.from_fd(fds[0], hello.arena_bytes, f"arena of lease {self.client_id}")
            # read-only: the control block is the server's (its descriptor is O_RDONLY)
            self._control = Segment.from_fd(fds[1], hello.control_bytes, "control segment",
                                            readonly=True)
            self._bell = Segment.from_fd(fds[2], hello.bell_bytes, "bell segment")
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory
        for seg, kind in ((self._control, "control"), (self._arena, "arena")):
            try:
                seg.ops.check_header(kind)
            except ValueError as e:
                raise errors.ShmServeError(f"{seg.name}: {e}", P.Status.INVALID_ARG) from None
        self._ctl, self._ops = self._control.ops, self._arena.ops
        try:
            self._ring = P.Ring(self._ops)  # this client's submission ring, in its arena
            # where the protocol's geometry puts it, as the server (which never reads
            # the header) takes it
            expected = _core.arena_layout(hello.n_slots, 0)[3:5]
            if (self._ring.offset, self._ring.capacity) != expected:
                raise ValueError(f"submission ring at {self._ring.offset} with "
                                 f"{self._ring.capacity} cells, expected {expected}")
        except ValueError as e:
            raise errors.ShmServeError(f"segment {self._arena.name}: {e}", P.Status.INVALID_ARG) from None
        self._slots_offset = hello.slots_offset
        self._alloc = ArenaAllocator(hello.data_offset, hello.arena_bytes)
        self._py_inputs = {"inputs_copied": 0, "inputs_adopted": 0}  # the Python path's counts
        # The slot table (requests in flight, orphans), the spin policy and the C path.
        self._core = ClientCore(self._ops, self._arena.mmap, self._ctl, self._bell.ops,
                                self.client_id, hello.slots_offset,
                                hello.n_slots, self._alloc, self._spin_ns,
                                MAX_SPIN_US * 1000 if self._spin_ns else 0, WAIT_SLICE_NS,
                                _C_TYPES)
        self._lock = threading.Lock()
        self._finishing = 0  # requests collected whose blocks are not freed yet
        self._plans: dict[tuple[str, int | None], Plan] = {}
        self._remember_models(hello.models)
        self._poller: threading.Thread | None = None
        # An idle poller (no future in flight) waits on this, not on the arena's
        # completions: those ring for every synchronous answer too, and a poller woken
        # for each would take the GIL and a CPU from the caller (identity 4 KiB in a
        # loop: 46k -> 15k infer/s while it lingered).
        self._poller_idle = False
        self._poller_wake = threading.Event()
        self._closed = False
        self._events = None  # gpu.ipc.SlotEvents, once a device tensor is sent

    # -- control plane ------------------------------------------------------------
    def call(self, request: P.Message, _fds: int = 0):
        """One control request; its typed reply (and with _fds, the descriptors received)."""
        try:
            frame = P.pack_frame(request)
        except ValueError as e:  # too large for a frame: nothing was sent
            raise errors.InvalidArgumentError(str(e)) from None
        with self._sock_lock:
            try:
                self._sock.sendall(frame)
                wire, fds = P.recv_frame_fds(self._sock, _fds)
            except P.TruncatedDescriptors as e:
                raise errors.ShmServeError(f"server '{self.name}': {e}", P.Status.INTERNAL) from None
            except (OSError, ConnectionError) as e:
                raise errors.ServerDeadError(f"server '{self.name}' is gone ({e})") from None
        try:
            reply = P.decode_reply(request, wire)
        except ValueError as e:
            reply = P.ErrorReply(int(P.Status.INTERNAL), f"malformed reply from the server: {e}")
        if isinstance(reply, P.ErrorReply):
            for fd in fds:
                os.close(fd)
            raise errors.from_status(reply.code, reply.error, reply.type)
        return (reply, fds) if _fds else reply

    def _remember_models(self, models: list[dict]) -> None:
        """Plans of these models, compiled for the C path: a model's first request
        (one the hello reply did not list) is the Python path's."""
        for m in models:
            plan = Plan(m)
            plan.fast = self._core.compile(plan)
            self._plans[(m["name"], m["version"])] = plan
            if plan.fast is not None:
                self._core.plans[(m["name"], m["version"])] = (plan, plan.fast)
            latest = self._plans.get((m["name"], None))
            if latest is None or latest.version < m["version"]:
                self._plans[(m["name"], None)] = plan
                if plan.fast is not None:
                    self._core.plans[m["name"]] = (plan, plan.fast)
                else:
                    self._core.plans.pop(m["name"], None)

    def forget(self, name: str) -> None:
        """Drops the plans of a model (loaded, unloaded or reloaded: its handle may
        have changed); its next request resolves it again."""
        with self._lock:
            for key in [k for k in self._plans if k[0] == name]:
                del self._plans[key]
            for key in [k for k in self._core.plans if k == name
                        or (isinstance(k, tuple) and k[0] == name)]:
                del self._core.plans[key]

    def plan(self, name: str, version) -> Plan:
        key = (name, version_key(version))
        plan = self._plans.get(key)
        if plan is None:  # the server words the error (unknown model or version)
            self._remember_models([dataclasses.asdict(self.call(P.GetMetadata(name, key[1])))])
            plan = self._plans[key]
        return plan

    # -- arena ------------------------------------------------------------------------
    def empty(self, shape, dtype) -> np.ndarray:
        """An array in this arena (Client.empty); its block is freed with the array."""
        dtype = np.dtype(dtype)
        if dtype.kind in "OSU":
            raise TypeError("empty() holds fixed-size types only; BYTES inputs are encoded by infer()")
        shape = tuple(int(d) for d in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        nbytes = int(math.prod(shape)) * dtype.itemsize
        offset = self.alloc(nbytes, "empty()")
        # The array's base is the block's owner: the block returns with the last view.
        return np.ndarray(shape, dtype, self._core.block(offset, nbytes))

    def alloc(self, nbytes: int, what: str) -> int:
        if nbytes > self._alloc.capacity:
            raise errors.InvalidArgumentError(
                f"{what} needs {nbytes} bytes but this client's arena holds "
                f"{self._alloc.capacity} (Client(arena_bytes=...); server limit --max-arena-bytes)")
        while True:
            try:
                return self._alloc.alloc(nbytes)
            except ArenaFull:
                if self._wait_any_completion():
                    continue
            try:  # nothing in flight now, but a request may have finished meanwhile
                return self._alloc.alloc(nbytes)
            except ArenaFull:
                raise errors.BusyError(
                    f"{what} needs {nbytes} bytes and the arena is full "
                    f"({self._alloc.used} of {self._alloc.capacity} bytes held by outputs "
                    "still referenced); release results or use a larger arena") from None

    # -- requests -------------------------------------------------------------------------
    def infer(self, model, inputs, outputs, version, timeout, copy: bool,
              options: tuple | None = None) -> InferResult:
        """One request, waited for (Client.infer): the C path, else the Python path.
        options: protocol.options()'s tuple, or None (every option at its default)."""
        if options is None:
            got = self._core.infer(self, model, inputs, outputs, version, timeout, copy)
        else:
            got = self._core.infer(self, model, inputs, outputs, version, timeout, copy, options)
        if got.__class__ is InferResult:
            return got
        if got is None:  # not for the C path: the Python path from the beginning
            return self.wait(self.start(model, inputs, outputs, version, copy, False, options),
                             timeout)
        # Sent and answered by the C path; the answer is Python's to finish.
        status, message, results, stamps, block, block_bytes, started = got
        req = Request()
        req.plan = plan = self.plan(model, version)
        req.copy, req.retried, req.future, req.options = copy, False, None, options
        req.block, req.block_bytes = block, block_bytes
        req.call = (model, inputs, outputs, version)
        try:  # kept for a resend (OUTPUT_TOO_SMALL, which works out sources from call)
            req.wanted = wanted(plan, outputs)
        except BaseException:
            self._alloc.free(block, block_bytes)
            raise
        result = self._answered(req, (status, message, results, stamps))
        if isinstance(result, Request):  # resent with bigger outputs
            return self.wait(result, timeout, started)
        return result

    def submit(self, model, inputs, outputs, version, copy: bool,
               options: tuple | None = None) -> ResultFuture:
        """Sends one request; its Future resolves to an InferResult (Client.submit)."""
        req = Request()
        req.copy, req.retried, req.future = copy, False, ResultFuture(self._cancelled)
        req.options = options
        # The caller may reuse its dict or list once submit() returned: a resend, and
        # the arena arrays the server reads in place, keep what was sent.
        if type(inputs) is dict:
            inputs = inputs.copy()
        elif type(inputs) is list:
            inputs = tuple(inputs)
        req.call = (model, inputs, outputs, version)
        sent = (self._core.send(self, req, model, inputs, outputs, version) if options is None
                else self._core.send(self, req, model, inputs, outputs, version, options))
        if not sent:
            req = self.start(model, inputs, outputs, version, copy, True, options)
        with self._lock:  # the poller runs, or is woken from its idle wait
            if self._poller is None or self._poller_idle:
                self._wake_poller()
        return req.future

    # -- streams (stream.py): several responses to one request ----------------------
    def stream(self, model, inputs, outputs, version, timeout, options: tuple | None,
               output_bytes: int = 0) -> ResponseStream:
        """Sends one STREAM request (Client.infer_stream) on the Python path; its
        responses are read by the returned iterator. output_bytes: each output buffer's
        size where the config leaves it open (default: as infer's guess)."""
        flags, *rest = options if options is not None else (0, 0, 0, None, 0)
        options = (flags | P.STREAM, *rest)
        needed = None
        if output_bytes:
            plan = self.plan(model, version)
            needed = {index: int(output_bytes) for index, _, _, dims in wanted(plan, outputs)
                      if dims is None}
        req = self.start(model, inputs, outputs, version, True, False, options, needed=needed)
        return ResponseStream(self, req, timeout)

    def wait_stream(self, req: Request, slot_off: int, timeout: float | None) -> tuple:
        """The next response of a stream: (status, message, results, stamps, index,
        final, empty). A RESPONSE is the caller's to hand back once read; the final one
        (DONE) leaves the slot FREE and the block the caller's to free."""
        started = self._now()
        deadline = None if timeout is None else started + int(timeout * 1e9)
        spin, ops = self._core.spin_budget(), self._ops
        while True:
            seen = ops.load32(L["arena.completions"])
            got = ops.read_response(slot_off)
            if got is not None:
                self._core.spin_record(self._now() - started)
                return (*got, False, False)
            if self._core.claim(req.slot, req):
                index = ops.load32(slot_off + L["slot.response_index"])
                flags = ops.load32(slot_off + L["slot.response_flags"])
                status, message, results, stamps = self._core.finish(
                    req.slot, req.block, req.block_bytes, None, True)
                return status, message, results, stamps, index, True, bool(flags & EMPTY)
            slice_ns = WAIT_SLICE_NS
            if deadline is not None:
                left = deadline - self._now()
                if left <= 0:
                    raise errors.ServerTimeoutError(
                        f"model '{req.plan.name}': no response within {timeout} s")
                slice_ns = min(slice_ns, left)
            # SYNC POINT: woken by the worker's doorbell_ring on arena.completions, rung
            # for every RESPONSE as for DONE.
            if not ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen, spin,
                                     slice_ns):
                self.check_server()

    def cancel_stream(self, req: Request, slot_off: int) -> None:
        """The caller stopped reading a stream: the model is asked to stop; slot and
        block come back with its final response (reap)."""
        self._ops.cancel(slot_off)
        self._core.abandon(req.slot, req.block, req.block_bytes)

    @property
    def counters(self) -> dict:
        """For tests and debugging: requests each path took a slot for so far, the C
        path ("c") and the Python path ("python", resends included); input tensors
        copied into the arena and used in place (already in it: "inputs_copied",
        "inputs_adopted", both paths); slots not free ("slots_busy": in flight or
        orphaned); bytes of the arena in use ("arena_used")."""
        counts = self._core.counts
        for key, n in self._py_inputs.items():
            counts[key] += n
        return {**counts, "slots_busy": self._core.busy, "arena_used": self._alloc.used}

    def _locate(self, arr: np.ndarray) -> int:
        """arr's offset in this arena's data area (zero-copy input), or -1."""
        offset = self._ops.locate(arr)
        return offset if offset >= self._alloc.begin and offset % P.DATA_ALIGN == 0 else -1

    def start(self, model, inputs, outputs, version, copy: bool, with_future: bool,
              options: tuple | None = None,
              future: ResultFuture | None = None, needed: dict | None = None
              ) -> Request:
        if self._closed:
            raise errors.ServerDeadError("client is closed")
        if self._ctl.load32(L["control.server_state"]) == P.ServerState.STOPPED:
            self.check_server()
        req = Request()
        req.plan = plan = self.plan(model, version)
        req.sources = sources(plan, inputs, self._locate)
        req.wanted = wanted(plan, outputs)
        req.destinations = destinations(plan, outputs)
        req.copy, req.retried, req.block, req.options = copy, False, None, options
        req.future = future or (ResultFuture(self._cancelled) if with_future else None)
        req.call = (model, inputs, outputs, version)
        self._prepare(req, needed)
        try:
            self._send(req)
        except BaseException:
            self._alloc.free(req.block, req.block_bytes)
            raise
        return req

    def _prepare(self, req: Request, needed: dict | None) -> None:
        """Lays out one arena block: copied inputs, then output buffers. Output sizes
        are exact when the config fixes the shape, otherwise a guess (the input size);
        a guess that is too small is retried once with the size the server reports."""
        plan = req.plan
        rows = 1
        if plan.batched and req.sources and req.sources[0][4]:
            rows = int(req.sources[0][4][0])
        layout, size, in_bytes, records = [], 0, 0, []
        for index, code, data, offset, shape in req.sources:
            nbytes = len(data) if code == _BYTES else data.nbytes
            if offset == DEVICE:  # in device memory: its CUDA IPC record in the block
                in_bytes += nbytes
                layout.append((index, code, data, size, nbytes, shape))
                size += _aligned(RECORD_BYTES)
                continue
            if nbytes > self._alloc.capacity:
                raise errors.InvalidArgumentError(
                    f"model '{plan.name}' input '{plan.meta['inputs'][index]['name']}' holds "
                    f"{nbytes} bytes but this client's arena holds {self._alloc.capacity} "
                    "(Client(arena_bytes=...); server limit --max-arena-bytes)")
            in_bytes += nbytes
            if offset < 0:
                layout.append((index, code, data, size, nbytes, shape))
                size += _aligned(nbytes)
            else:
                layout.append((index, code, None, offset, nbytes, shape))
            self._py_inputs["inputs_copied" if offset < 0 else "inputs_adopted"] += 1
        outputs = []
        destinations = getattr(req, "destinations", None) or {}
        for index, name, itemsize, dims in req.wanted:
            if index in destinations:  # the caller's device buffer: a record here
                src = destinations[index][0]
                outputs.append((index, 0, size, src.nbytes, (), src))
                size += _aligned(RECORD_BYTES)
                continue
            if needed and index in needed:
                nbytes = needed[index]
            elif dims is not None:
                nbytes = rows * int(math.prod(dims)) * itemsize
            else:
                nbytes = max(in_bytes, 4096)
            outputs.append((index, 0, size, nbytes, (), None))
            size += _aligned(nbytes)
        packed = req.options[3] if req.options is not None else None
        params_at = size  # the packed parameters after the output buffers, as the C path
        if packed:
            size += _aligned(len(packed))
        string_id = req.options[5] if req.options is not None and len(req.options) > 5 else None
        string_id_at = size  # a string correlation id after them (the Python path only)
        if string_id:
            size += _aligned(len(string_id))
        block = self.alloc(size, f"request to model '{plan.name}'")
        if packed:
            self._ops.put(block + params_at, packed)
        req.params_offset = block + params_at if packed else 0
        if string_id:
            self._ops.put(block + string_id_at, string_id)
        req.string_id_offset = block + string_id_at if string_id else 0
        refs = []
        for index, code, data, offset, nbytes, shape in layout:
            if data.__class__ is DeviceSourceType():  # its record is written at _send
                records.append((block + offset, data))
                refs.append(_core.TensorRef((index, code, block + offset, nbytes, shape,
                                             CUDA_IPC, data.ordinal)))
                continue
            if data is not None:
                offset += block
                self._ops.put(offset, data)
            refs.append((index, code, offset, nbytes, shape))
        req.block, req.block_bytes = block, size
        req.outputs = []
        for i, c, o, n, s, src in outputs:
            if src is None:
                req.outputs.append((i, c, block + o, n, s))
            else:  # an output's record: no event (the worker synchronizes before answering)
                self._ops.put(block + o, src.record(None))
                req.outputs.append(_core.TensorRef((i, c, block + o, n, s, CUDA_IPC, src.ordinal)))
        req.sources_refs = refs
        req.device_records = records

    def _send(self, req: Request) -> None:
        # A cancel() from the caller leaves a request alone while it is sent (the
        # poller sends one again, with bigger outputs or to a reloaded model): it would
        # orphan the slot this sending still owns. Its answer is dropped instead.
        req.sending = True
        try:
            self._send_now(req)
        finally:
            req.sending = False

    def _send_now(self, req: Request) -> None:
        slot = self._acquire_slot()
        req.slot = slot
        # In flight from here: its waiter (claim) or the poller (collect) finishes it.
        req.generation = gen = self._core.register(slot, req, req.future is not None)
        slot_off = self._slots_offset + slot * P.SLOT_BYTES
        try:
            records = getattr(req, "device_records", None)
            outputs = [src for src, _ in (getattr(req, "destinations", None) or {}).values()]
            if records:  # the inputs' event, recorded now on their streams (and the
                # output buffers' streams: the server writes them after that wait)
                event = self._device_events().record(slot, [src for _, src in records] + outputs)
                for offset, src in records:
                    self._ops.put(offset, src.record(event))
            elif outputs:  # no input event to order them: their pending work finishes first
                self._device_events().settle(outputs)
            if req.options is None:
                self._ops.write_request(slot_off, gen, req.plan.id, req.sources_refs, req.outputs)
            else:
                flags, priority, timeout_us, packed, sequence_id, *string_id = req.options
                self._ops.write_request(slot_off, gen, req.plan.id, req.sources_refs, req.outputs,
                                        flags, priority, timeout_us, req.params_offset,
                                        len(packed) if packed else 0, sequence_id,
                                        req.string_id_offset, len(string_id[0]) if string_id else 0)
        except (ValueError, TypeError, OverflowError, RuntimeError) as e:  # e.g. more dims
            self._core.release_slot(slot)  # than MAX_DIMS, a CUDA error recording the event
            raise errors.InvalidArgumentError(f"model '{req.plan.name}': {e}") from None
        try:
            rc = self._ring.push_request(self._ctl, self._bell.ops, self.client_id, slot, gen,
                                         self.check_server)
        except errors.ServerDeadError:
            rc = -1
        # The slot goes back to FREE only if the batcher has not taken it meanwhile
        # (its sweep takes SUBMITTED requests the ring lost): then it is in flight.
        if rc != P.RingResult.OK and self._ops.withdraw(slot_off):
            self._core.release_slot(slot)
            self._push_failed(rc)

    def _push_failed(self, rc: int):
        """Raises the error of a request whose push failed (rc: shms_push_request's
        result, -1 when the lease ended) and that was taken back; the C path too."""
        if rc < 0:
            self.check_server()  # says why (the lease or the server ended)
            raise errors.ServerDeadError(f"server '{self.name}' ended this client's lease")
        if rc == P.RingResult.FULL:
            raise errors.BusyError(f"server '{self.name}': this client's submission ring is full "
                                   "(damaged by a thread of this process); retry later")
        raise errors.BusyError(f"server '{self.name}': the batcher skipped this client's ring "
                               "entry again and again (a thread of this process is damaging "
                               "its submission ring); retry later")

    def _acquire_slot(self) -> int:
        """A free slot; waits for one while every slot is in flight (or orphaned: they
        come back once the server answered them)."""
        while (slot := self._core.acquire_slot(WAIT_SLICE_NS)) is None:
            self.check_server()
        return slot

    # -- completion ----------------------------------------------------------------------
    def check_server(self) -> None:
        """Raises ServerDeadError if the server stopped or died: its pid, and
        end-of-file on the control socket (the lease), say so. control.server_state is
        only a hint: any client can write it, so it only words the error."""
        stopped = self._ctl.load32(L["control.server_state"]) == P.ServerState.STOPPED
        if not pid_alive(self.server_pid):
            raise errors.ServerDeadError(f"server '{self.name}' " + (
                "has stopped" if stopped else f"(pid {self.server_pid}) died"))
        if self._sock_lock.acquire(blocking=False):
            try:
                eof = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                eof = False
            except OSError:
                eof = True
            finally:
                self._sock_lock.release()
            if eof:
                raise errors.ServerDeadError(f"server '{self.name}' " + (
                    "has stopped" if stopped else "closed this client's lease"))

    def wait(self, req: Request, timeout: float | None, started: int | None = None) -> InferResult:
        started = self._now() if started is None else started
        deadline = None if timeout is None else started + int(timeout * 1e9)
        spin = self._core.spin_budget()
        while True:
            seen = self._ops.load32(L["arena.completions"])
            if self._core.claim(req.slot, req):
                self._core.spin_record(self._now() - started)
                result = self._finish(req)
                if isinstance(result, Request):  # resent with bigger outputs
                    req = result
                    continue
                return result
            slice_ns = WAIT_SLICE_NS
            if deadline is not None:
                left = deadline - self._now()
                if left <= 0:
                    self._abandon(req)
                    raise errors.ServerTimeoutError(
                        f"model '{req.plan.name}': no answer within {timeout} s")
                slice_ns = min(slice_ns, left)
            # SYNC POINT: woken by the worker's doorbell_ring on arena.completions.
            if not self._ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen,
                                           spin, slice_ns):
                try:
                    self.check_server()
                except errors.ServerDeadError:
                    self._abandon(req)
                    raise

    def _abandon(self, req: Request) -> None:
        """The caller stopped waiting: slot and block stay reserved until the answer."""
        self._core.abandon(req.slot, req.block, req.block_bytes)

    def _finish(self, req: Request):
        """Reads a claimed DONE slot: returns an InferResult, raises the request's
        error, or returns the request resent when an output buffer was too small."""
        # The slot is FREE again; stamps end with CLIENT_WAKE, taken at the read.
        got = self._core.finish(req.slot, req.block, req.block_bytes, req.plan.fast, req.copy)
        if got.__class__ is InferResult:  # built by the C core, as the C path's
            if req.future is not None and not req.future.resolve(got):
                got.release()  # cancelled meanwhile: nobody takes it
            return got
        return self._answered(req, got)

    def _answered(self, req: Request, answer: tuple):
        """An answer the C core left to Python: (status, message, results, stamps)."""
        status, message, results, stamps = answer
        if status == P.Status.OUTPUT_TOO_SMALL and not req.retried and \
                not getattr(req, "destinations", None):  # a device buffer cannot grow
            self._alloc.free(req.block, req.block_bytes)
            req.retried = True
            if getattr(req, "sources", None) is None:  # sent by the C path: from the call
                req.sources = sources(req.plan, req.call[1], self._locate)
            self._prepare(req, {r[0]: r[3] for r in results})
            try:
                self._send(req)
            except BaseException:
                self._alloc.free(req.block, req.block_bytes)
                raise
            return req
        if status != P.Status.OK:
            self._alloc.free(req.block, req.block_bytes)
            if status == P.Status.UNAVAILABLE and P.STALE_MODEL_ID in message:
                resent = self._resolve_again(req, message)
                if resent is not None:
                    return resent
            raise errors.from_status(status, message)
        owner = self._core.block(req.block, req.block_bytes)  # from here it holds the block
        try:
            result = self._outputs(req, owner, results, stamps)
        except BaseException:
            owner.release()
            raise
        if req.future is not None and not req.future.resolve(result):
            result.release()
        return result

    def _resolve_again(self, req: Request, message: str) -> Request | None:
        """A request refused because its model handle went stale (docs/protocol.md,
        "Model handles"): the server never ran it, so once the model was reloaded it
        is sent again, once, to the model the name resolves to now. None: it is not
        (unloaded, or already sent again); the caller raises the server's error."""
        self.forget(req.plan.name)
        call, req.call = getattr(req, "call", None), None
        if call is None or "unloaded" in message.split(f"({P.STALE_MODEL_ID}", 1)[0]:
            return None
        model, inputs, outputs, version = call
        try:
            resent = self.start(model, inputs, outputs, version, req.copy,
                                req.future is not None, req.options, future=req.future)
        except errors.ShmServeError:
            return None  # the name no longer resolves: the stale error says why
        resent.call = None
        return resent

    def _outputs(self, req: Request, owner, results: list, stamps: tuple) -> InferResult:
        """Output arrays as views of the request's block (`owner`, an ArenaBlock). The
        block returns to the arena when the last view is gone (or at release(), or at
        once with copy or BYTES outputs, which are decoded)."""
        begin, end = req.block, req.block + req.block_bytes
        block = np.frombuffer(owner, np.uint8)
        names = req.plan.output_names
        arrays = {}
        destinations = getattr(req, "destinations", None)
        for ref in results:
            index, dtype, offset, nbytes, shape = ref
            if ref.__class__ is _core.TensorRef and ref.memory_kind and destinations:
                arrays[names[index]] = _written(destinations, index, shape, req.plan.name)
                continue
            if index >= len(names) or offset < begin or offset + nbytes > end:
                raise errors.BadDescriptorError(f"model '{req.plan.name}': server answered with "
                                                "an output outside the buffers it was given")
            raw = block[offset - begin:offset - begin + nbytes]
            if dtype == _BYTES:
                arr = P.decode_bytes(raw, shape)
            else:
                arr = raw.view(P.numpy_dtype(dtype)).reshape(shape)
                if req.copy:
                    arr = arr.copy()
            arrays[names[index]] = arr
        if req.copy or all(a.dtype == object for a in arrays.values()):
            owner.release()
            blocks = []
        else:  # views of `block` keep its owner alive; the memory returns after the last
            blocks = [owner]
        return InferResult(arrays, stamps, req.plan.name, req.plan.version, blocks)

    def _device_events(self):
        """The slots' interprocess events (gpu/ipc.py), made once a device tensor is sent."""
        if self._events is None:
            from ..gpu.ipc import SlotEvents
            self._events = SlotEvents()
        return self._events

    def _wait_any_completion(self) -> bool:
        """Waits until an in-flight request of this client finishes (arena pressure).
        Returns False if nothing is in flight."""
        if self._core.reap():  # orphans answered: their blocks are back
            return True
        with self._lock:
            if not self._core.busy:
                if not self._finishing:
                    return False
                finishing = True
            else:
                finishing = False
        if finishing:  # another thread is about to free its blocks
            time.sleep(0.0001)
            return True
        seen = self._ops.load32(L["arena.completions"])
        if self._collect():
            return True
        self._ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen,
                                self._spin_ns if not self.crowded() else 0, WAIT_SLICE_NS)
        self._collect()
        return True

    def crowded(self) -> bool:
        """The server's hint that no CPU is idle to spin on (docs/protocol.md, section 8)."""
        try:
            return bool(self._ctl.load32(L["control.crowded"]))
        except ValueError:  # close() released the mapping: the caller finds out next
            return False

    # -- futures: one poller thread resolves submitted requests --------------------------
    def _wake_poller(self) -> None:
        """Under self._lock: starts the poller, or wakes it from its idle wait."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="shmserve-completions",
                                            daemon=True)
            self._poller.start()
        else:  # the request is registered: it finds it when awake
            self._poller_idle = False
            self._poller_wake.set()

    def _cancelled(self, future: ResultFuture) -> None:
        """A submitted request's future was cancelled: its request is abandoned (the
        server still runs it; slot and block come back with its answer) unless the
        poller already took it or is sending it again, which then drops its answer
        (ResultFuture.resolve)."""
        with self._lock:  # the lock _collect takes the requests out of flight under
            for req in self._core.futures():
                if req.future is future and not getattr(req, "sending", False):
                    self._abandon(req)
                    return

    def _collect(self) -> int:
        """Finishes every submitted request that is DONE; returns how many."""
        with self._lock:
            ready = self._core.collect()  # out of the in-flight table: ours to finish
            self._finishing += len(ready)
        try:
            for req in ready:
                try:
                    self._finish(req)  # resolves the future (or resends the request)
                except errors.ShmServeError as e:
                    req.future.fail(e)
        finally:
            with self._lock:
                self._finishing -= len(ready)
        return len(ready)

    def _poll(self) -> None:
        try:
            self._poll_until_idle()
        except ValueError:  # the mappings were released under it: closed meanwhile
            if not self._closed:
                raise

    def _poll_until_idle(self) -> None:
        idle_since = None  # when the last future in flight resolved
        while not self._closed:
            seen = self._ops.load32(L["arena.completions"])
            self._collect()
            with self._lock:  # decided under the lock submit() takes
                in_flight = self._core.n_futures
                if in_flight:
                    idle_since = None
                elif idle_since is None:
                    idle_since = self._now()
                elif self._now() - idle_since >= POLLER_IDLE_NS:
                    self._poller = None
                    return
                if not in_flight:  # a submit from now on sets the event (_wake_poller)
                    self._poller_idle = True
                    self._poller_wake.clear()
            if not in_flight:
                left = POLLER_IDLE_NS - (self._now() - idle_since)
                self._poller_wake.wait(max(0, min(left, WAIT_SLICE_NS)) / 1e9)
                with self._lock:
                    self._poller_idle = False
                continue
            # It spins for one request in flight, where a wake-up would be most of the
            # latency. With several, answers come in batches that share one wake-up, and
            # a spin takes the CPU the server needs: sched_yield does not yield to tasks
            # of another cgroup or session (autogroup), which is where a server usually
            # runs (bench/README.md, "Two things the suite's client processes taught").
            # Nor while the server says other work leaves no CPU idle (control.crowded).
            spin = self._spin_ns if in_flight == 1 and not self.crowded() else 0
            if not self._ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen,
                                           spin, WAIT_SLICE_NS):
                if self._closed:  # close() released the mappings while we waited
                    return
                try:
                    self.check_server()
                except errors.ServerDeadError as e:
                    with self._lock:
                        self._poller = None
                    self._fail_all(e)
                    return

    def _fail_all(self, exc: Exception) -> None:
        for req in self._core.futures():
            req.future.fail(exc)

    @staticmethod
    def _now() -> int:
        return P.now_ns()

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the lease: the server reclaims the arena. Output arrays still referenced
        keep their mapping alive until they are freed."""
        if self._closed:
            return
        self._closed = True
        self._poller_wake.set()  # an idle poller leaves at once
        self._core.close()
        if self._events is not None:
            self._events.close()
        self._fail_all(errors.ServerDeadError("client closed"))
        try:
            self._sock.close()
        finally:
            self._control.close()
            self._bell.close()
            self._arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
