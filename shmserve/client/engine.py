"""The client engine: one lease on a server (control socket, the mapped control
segment and arena, slots) and the life of each request in it. It writes requests
into its own arena, pushes them on the ring and waits on a futex for the answer; the
slot procedures themselves are the C core's (shms_slot.h). Client (client.py) is the
facade callers use.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import socket
import threading
import time
import weakref

import numpy as np

from .. import errors
from .. import protocol as P
from .._core import AdaptiveSpin
from ..protocol import LAYOUT as L
from ..segments import DEFAULT_NAME, Segment, pid_alive, socket_path
from .arena import ArenaAllocator, ArenaFull
from .request import Plan, Request, sources, version_key, wanted
from .result import InferResult

_BYTES = P.DataType.BYTES
WAIT_SLICE_NS = 50_000_000  # between liveness checks of the server while waiting
SPIN_US = 100  # a caller spins at least this long for its answer before it sleeps
MAX_SPIN_US = 1000  # ... and up to this long when its answers usually take that long


def _aligned(n: int) -> int:
    return (max(n, 1) + P.DATA_ALIGN - 1) // P.DATA_ALIGN * P.DATA_ALIGN


class Engine:
    """A lease on a running server and the life of its requests: start() writes one
    into a slot and pushes it, wait() (or the poller thread, for futures) reads its
    answer. Thread-safe. Facades (Client, and the network fronts to come) build on it;
    parameters as Client's."""

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
        hello, fds = self.call(P.Hello(P.PROTOCOL_VERSION, os.getpid(), arena_bytes or 0), _fds=2)
        self.client_id = hello.client_id
        self.server_pid = hello.server_pid
        self._spin_ns = int((SPIN_US if spin_us is None else spin_us) * 1000)
        self._spin = AdaptiveSpin(self._spin_ns, MAX_SPIN_US * 1000 if self._spin_ns else 0)
        try:  # the arena's and the control segment's sealed memfds came with the reply
            if len(fds) != 2:
                raise errors.ShmServeError(f"hello reply carried {len(fds)} descriptors, not 2 "
                                           "(arena, control)", P.Status.INTERNAL)
            self._arena = Segment.from_fd(fds[0], hello.arena_bytes, f"arena of lease {self.client_id}")
            self._control = Segment.from_fd(fds[1], hello.control_bytes, "control segment")
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
            self._ring = P.Ring(self._ctl)
        except ValueError as e:
            raise errors.ShmServeError(f"segment {self._control.name}: {e}", P.Status.INVALID_ARG) from None
        self._buf = self._arena.buffer
        self._slots_offset = hello.slots_offset
        self._alloc = ArenaAllocator(hello.data_offset, hello.arena_bytes)
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._free_slots = list(range(hello.n_slots - 1, -1, -1))
        self._generations = [0] * hello.n_slots
        self._inflight: dict[int, Request] = {}
        self._finishing = 0  # requests taken out of _inflight whose blocks are not freed yet
        self._orphans: set[int] = set()
        self._plans: dict[tuple[str, int | None], Plan] = {}
        self._remember_models(hello.models)
        self._poller: threading.Thread | None = None
        self._closed = False

    # -- control plane ------------------------------------------------------------
    def call(self, request: P.Message, _fds: int = 0):
        """One control request; its typed reply (and with _fds, the descriptors received)."""
        with self._sock_lock:
            try:
                self._sock.sendall(P.pack_frame(request))
                wire, fds = P.recv_frame_fds(self._sock, _fds)
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
        for m in models:
            plan = Plan(m)
            self._plans[(m["name"], m["version"])] = plan
            latest = self._plans.get((m["name"], None))
            if latest is None or latest.version < m["version"]:
                self._plans[(m["name"], None)] = plan

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
        flat = np.frombuffer(self._buf, dtype, nbytes // dtype.itemsize, offset)
        weakref.finalize(flat, self._alloc.free, offset, nbytes)
        return flat.reshape(shape)

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
    def _locate(self, arr: np.ndarray) -> int:
        """arr's offset in this arena's data area (zero-copy input), or -1."""
        offset = self._ops.locate(arr)
        return offset if offset >= self._alloc.begin and offset % P.DATA_ALIGN == 0 else -1

    def start(self, model, inputs, outputs, version, copy: bool, with_future: bool) -> Request:
        if self._closed:
            raise errors.ServerDeadError("client is closed")
        if self._ctl.load32(L["control.server_state"]) == P.ServerState.STOPPED:
            self.check_server()
        req = Request()
        req.plan = plan = self.plan(model, version)
        req.sources = sources(plan, inputs, self._locate)
        req.wanted = wanted(plan, outputs)
        req.copy, req.retried, req.block = copy, False, None
        req.future = concurrent.futures.Future() if with_future else None
        self._prepare(req, None)
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
        layout, size, in_bytes = [], 0, 0
        for index, code, data, offset, shape in req.sources:
            nbytes = len(data) if code == _BYTES else data.nbytes
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
        outputs = []
        for index, name, itemsize, dims in req.wanted:
            if needed and index in needed:
                nbytes = needed[index]
            elif dims is not None:
                nbytes = rows * int(math.prod(dims)) * itemsize
            else:
                nbytes = max(in_bytes, 4096)
            outputs.append((index, 0, size, nbytes, ()))
            size += _aligned(nbytes)
        block = self.alloc(size, f"request to model '{plan.name}'")
        refs = []
        for index, code, data, offset, nbytes, shape in layout:
            if data is not None:
                offset += block
                self._ops.put(offset, data)
            refs.append((index, code, offset, nbytes, shape))
        req.block, req.block_bytes = block, size
        req.outputs = [(i, c, block + o, n, s) for i, c, o, n, s in outputs]
        req.sources_refs = refs

    def _send(self, req: Request) -> None:
        slot = self._acquire_slot()
        gen = (self._generations[slot] + 1) & 0xFFFFFFFF
        self._generations[slot] = gen
        req.slot, req.generation = slot, gen
        slot_off = self._slots_offset + slot * P.SLOT_BYTES
        with self._lock:
            self._inflight[slot] = req
        try:
            self._ops.write_request(slot_off, gen, req.plan.id, req.sources_refs, req.outputs)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. more dims than MAX_DIMS
            with self._lock:
                del self._inflight[slot]
            self._release_slot(slot)
            raise errors.InvalidArgumentError(f"model '{req.plan.name}': {e}") from None
        try:
            rc = self._ring.push_request(self.client_id, slot, gen, self.check_server)
        except errors.ServerDeadError:
            rc = None
        # The slot goes back to FREE only if the batcher has not taken it meanwhile
        # (its sweep takes SUBMITTED requests the ring lost): then it is in flight.
        if rc != P.RingResult.OK and self._ops.withdraw(slot_off):
            with self._lock:
                del self._inflight[slot]
            self._release_slot(slot)
            if rc is None:
                self.check_server()  # says why (the lease or the server ended)
                raise errors.ServerDeadError(f"server '{self.name}' ended this client's lease")
            if rc == P.RingResult.FULL:
                raise errors.BusyError(f"server '{self.name}' request ring is full; retry later")
            raise errors.BusyError(f"server '{self.name}': the batcher skipped this client's ring "
                                   "entry again and again (another client is damaging the "
                                   "ring); retry later")

    def _acquire_slot(self) -> int:
        with self._slot_free:
            while not self._free_slots:
                self._reap_orphans()
                if self._free_slots:
                    break
                self._slot_free.wait(0.05)
                self.check_server()
            return self._free_slots.pop()

    def _release_slot(self, slot: int) -> None:
        with self._slot_free:
            self._free_slots.append(slot)
            self._slot_free.notify()

    def _reap_orphans(self) -> None:
        """Slots whose caller gave up (timeout) come back once the server answered."""
        for slot in list(self._orphans):
            if self._ops.is_done(self._slots_offset + slot * P.SLOT_BYTES):
                self._orphans.discard(slot)
                req = self._inflight.pop(slot, None)
                if req:
                    self._alloc.free(req.block, req.block_bytes)
                self._free_slots.append(slot)

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

    def _done(self, req: Request) -> bool:
        return self._ops.is_done(self._slots_offset + req.slot * P.SLOT_BYTES)

    def wait(self, req: Request, timeout: float | None) -> InferResult:
        started = self._now()
        deadline = None if timeout is None else started + int(timeout * 1e9)
        spin = self._spin.budget_ns()
        while True:
            seen = self._ops.load32(L["arena.completions"])
            if self._claim(req):
                self._spin.record(self._now() - started)
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
        with self._lock:
            self._orphans.add(req.slot)

    def _finish(self, req: Request):
        """Reads a DONE slot: returns an InferResult, raises the request's error, or
        returns the request resent when an output buffer was too small."""
        slot_off = self._slots_offset + req.slot * P.SLOT_BYTES
        # The slot is FREE again; stamps end with CLIENT_WAKE, taken at the read.
        status, message, results, stamps = self._ops.read_result(slot_off)
        self._release_slot(req.slot)
        if status == P.Status.OUTPUT_TOO_SMALL and not req.retried:
            self._alloc.free(req.block, req.block_bytes)
            req.retried = True
            self._prepare(req, {r[0]: r[3] for r in results})
            self._send(req)
            return req
        if status != P.Status.OK:
            self._alloc.free(req.block, req.block_bytes)
            raise errors.from_status(status, message)
        try:
            result = self._outputs(req, results, stamps)
        except BaseException:
            self._alloc.free(req.block, req.block_bytes)
            raise
        if req.future is not None:
            req.future.set_result(result)
        return result

    def _outputs(self, req: Request, results: list, stamps: tuple) -> InferResult:
        """Output arrays as views of the request's block. The block returns to the
        arena when the last view is gone (or at release(), or at once with copy)."""
        begin, end = req.block, req.block + req.block_bytes
        block = np.frombuffer(self._buf, np.uint8, req.block_bytes, begin)
        names = req.plan.output_names
        arrays = {}
        for index, dtype, offset, nbytes, shape in results:
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
            self._alloc.free(req.block, req.block_bytes)
            finalizers = []
        else:  # views of `block` keep it alive; its memory is freed after the last one
            finalizers = [weakref.finalize(block, self._alloc.free, req.block, req.block_bytes)]
        return InferResult(arrays, stamps, req.plan.name, req.plan.version, finalizers)

    def _wait_any_completion(self) -> bool:
        """Waits until an in-flight request of this client finishes (arena pressure).
        Returns False if nothing is in flight."""
        with self._lock:
            if not self._inflight:
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
        self._ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen, self._spin_ns,
                                WAIT_SLICE_NS)
        self._collect()
        return True

    # -- futures: one poller thread resolves submitted requests --------------------------
    def ensure_poller(self) -> None:
        with self._lock:
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="shmserve-completions",
                                                daemon=True)
                self._poller.start()

    def _claim(self, req: Request) -> bool:
        """Takes a DONE request out of the in-flight table; only the thread that
        claimed it may finish it."""
        with self._lock:
            if self._inflight.get(req.slot) is req and self._done(req):
                del self._inflight[req.slot]
                return True
            return False

    def _collect(self) -> int:
        """Finishes every submitted request that is DONE; returns how many."""
        with self._lock:
            ready = [r for r in self._inflight.values()
                     if r.future is not None and r.slot not in self._orphans and self._done(r)]
            for r in ready:
                del self._inflight[r.slot]
            self._finishing += len(ready)
        for req in ready:
            try:
                self._finish(req)  # resolves the future (or resends the request)
            except errors.ShmServeError as e:
                req.future.set_exception(e)
            finally:
                with self._lock:
                    self._finishing -= 1
        return len(ready)

    def _poll(self) -> None:
        while not self._closed:
            seen = self._ops.load32(L["arena.completions"])
            self._collect()
            with self._lock:  # decided under the lock _ensure_poller takes
                if not any(r.future is not None for r in self._inflight.values()):
                    self._poller = None
                    return
            if not self._ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen,
                                           self._spin_ns, WAIT_SLICE_NS):
                try:
                    self.check_server()
                except errors.ServerDeadError as e:
                    with self._lock:
                        self._poller = None
                    self._fail_all(e)
                    return

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            pending = [r for r in self._inflight.values() if r.future is not None]
        for req in pending:
            if not req.future.done():
                req.future.set_exception(exc)

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
        self._fail_all(errors.ServerDeadError("client closed"))
        try:
            self._sock.close()
        finally:
            self._control.close()
            self._arena.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
