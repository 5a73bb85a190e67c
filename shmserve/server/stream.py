"""The worker's side of a STREAM request (docs/protocol.md section 6a): the responses
a decoupled model sends for one request, published one at a time in the caller's slot.

A response is written into the caller's output buffers and published (RUNNING ->
RESPONSE); the caller copies it out and hands the slot back (RESPONSE -> RUNNING)
before the next may be written, so the buffers are never overwritten under a reader.
The final response completes the slot (DONE) as a plain request's answer does.

ResponseStream.send may be called from any thread of the worker (a model may answer
after execute() returned); one lock keeps one request's responses in order. Nothing
the caller writes is trusted: the slot state is checked by compare-and-swap, the
`cancel` word only makes sends no-ops for that caller's own request, and a caller that
stops handing back is waited for in slices that watch its lease.
"""
from __future__ import annotations

import logging
import threading

from ..protocol import LAYOUT, ClientState, Duration, SlotState, Status, Timestamp, clip_error

L = LAYOUT
FINAL, EMPTY = L["RESPONSE_FINAL"], L["RESPONSE_EMPTY"]
HAND_BACK_SLICE_NS = 5_000_000  # between checks of the caller's lease and cancel word
log = logging.getLogger("shmserve.worker")


class ResponseStream:
    """The responses to one request of a decoupled model (worker.Request `req`)."""

    def __init__(self, worker, req):
        self.worker, self.req = worker, req
        self.lock = threading.Lock()
        self.sent = 0  # responses published so far (the next one's index)
        self.final = False  # the final flag was sent (or the request failed)
        self.gone = False  # the caller left or cancelled: responses are dropped
        self.done = threading.Event()  # set with the final response

    # -- what the model asks ----------------------------------------------------------
    def cancelled(self) -> bool:
        """The caller asked to stop (its `cancel` word), or left (its lease ended)."""
        if self.gone or self.final:
            return self.gone
        req = self.req
        try:
            asked = req.arena.ops.load32(req.slot_off + L["slot.cancel"]) != 0
        except (ValueError, IndexError):  # the arena was unmapped: the caller is gone
            asked = True
        if asked or not self._lease_alive():
            self.gone = True
        return self.gone

    def send(self, outputs: dict | None, error: tuple | None, final: bool) -> None:
        """One response: outputs ({name: array}, checked here), or error (status,
        message), or neither with final (the final flag alone). The caller raises
        if the final flag was sent already."""
        with self.lock:
            if self.final:
                raise RuntimeError("the final response was sent already")
            try:
                self._send(outputs, error, final)
            finally:
                if final:
                    self._finished(error[0] if error else Status.OK)

    def fail(self, status: int, message: str) -> None:
        """Ends a request that has not had its final response: its caller gets the error."""
        with self.lock:
            if self.final:
                return
            try:
                self._send(None, (status, message), True)
            finally:
                self._finished(status)

    # -- how ---------------------------------------------------------------------------
    def _send(self, outputs, error, final: bool) -> None:
        w, req = self.worker, self.req
        if self.sent == 0:  # Triton's first-response time: from the request's arrival
            w.maps.srv.record_waits(w.model_off, Duration.FIRST_RESPONSE, [req.taken_ns])
        if not self._wait_hand_back():
            if final:  # the caller cancelled: its slot still needs its DONE to come back
                self._complete(Status.OK, "", [], EMPTY)
            return
        status, msg, results = Status.OK, "", []
        if error is not None:
            status, msg = error
        elif outputs is not None:
            try:
                checked = w.check_outputs(outputs, req.rows, [w.spec.outputs[ref[0]].name
                                                              for ref in req.outputs])
                status, msg, results = w.scatter(req, checked, 0)
            except Exception as e:  # noqa: BLE001 - the caller hears why, the model goes on
                status, msg = getattr(e, "status", Status.INTERNAL), str(e)
                log.warning("model '%s': response %d not sent: %s", w.spec.name, self.sent, e)
        index = self.sent
        self.sent += 1
        if final:
            empty = EMPTY if outputs is None and error is None else 0
            self._complete(status, msg, results, empty, index)
            return
        try:
            published = req.arena.ops.respond(req.slot_off, req.generation, int(status),
                                              clip_error(msg), results, index)
        except (ValueError, IndexError):
            published = False
        if not published:
            self.gone = True

    def _complete(self, status, msg: str, results: list, flags: int, index: int | None = None):
        req = self.req
        try:  # the slot is ours until DONE: its last compute stamp goes first
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            req.arena.ops.complete(req.slot_off, req.generation, int(status), clip_error(msg),
                                   results, self.sent if index is None else index, flags)
        except (ValueError, IndexError) as e:  # the caller unmapped or broke its arena
            log.debug("client %d: stream not completed: %s", req.client_id, e)

    def _wait_hand_back(self) -> bool:
        """Waits until the caller handed back the previous response. True when the slot
        is ours to write (RUNNING, our generation); False when the caller left, or
        cancelled (the response is dropped)."""
        req = self.req
        ops, state_off = req.arena.ops, req.slot_off + L["slot.state"]
        sleeping_off = req.slot_off + L["slot.stream_sleeping"]
        gen_off = req.slot_off + L["slot.generation"]
        while not self.gone:
            try:
                if ops.load32(gen_off) != req.generation:
                    break
                state = ops.load32(state_off)
                if state == SlotState.RUNNING:
                    return not self.cancelled()
                if state != SlotState.RESPONSE or self.cancelled():
                    break
                # SYNC POINT: woken by the client's hand-back (CAS RESPONSE -> RUNNING,
                # then a wake if stream_sleeping) or cancel (shms_slot.h).
                ops.doorbell_wait(state_off, sleeping_off, SlotState.RESPONSE, 0,
                                  HAND_BACK_SLICE_NS)
            except (ValueError, IndexError):  # the arena was unmapped
                break
        self.gone = True
        return False

    def _lease_alive(self) -> bool:
        req = self.req
        return self.worker.maps.lease_of(req.client_id) == (ClientState.ALIVE, req.lease)

    def _finished(self, status: int) -> None:
        self.final = True
        self.worker.maps.srv.record_answers(self.worker.model_off,
                                            [(int(status), self.req.taken_ns)])
        self.done.set()
