"""The caller's side of a stream request (Client.infer_stream; docs/protocol.md
section 6a): the responses of one request, read from its slot one at a time.

The worker publishes a response (state RESPONSE); the reader copies its outputs out of
the request's output buffers and hands the slot back (RESPONSE -> RUNNING) so the next
may be written; the final response completes the slot (DONE) as a plain answer does.
No message crosses a socket per response: a response costs the worker's doorbell ring
and the hand-back's compare-and-swap (and a futex wake only if the worker sleeps).
"""
from __future__ import annotations

import numpy as np

from .. import errors
from .. import protocol as P
from ..protocol import LAYOUT as L
from .result import StreamResponse

EMPTY = L["RESPONSE_EMPTY"]


class ResponseStream:
    """Iterator over the responses of one stream request (Engine.stream). Closing it
    (close(), or dropping it) before the final response cancels the request: the model
    sees is_cancelled(), and slot and buffers come back once it sent its final flag."""

    def __init__(self, engine, req, timeout: float | None):
        self._engine, self._req, self._timeout = engine, req, timeout
        self._slot_off = engine._slots_offset + req.slot * P.SLOT_BYTES
        self._open = True  # in flight: neither finished nor cancelled

    def __iter__(self):
        return self

    def __next__(self) -> StreamResponse:
        return self._next(self._timeout, False)

    def poll(self, timeout: float) -> StreamResponse | None:
        """The next response, or None when none came within `timeout` seconds: the
        request stays in flight (for a reader that also watches something else between
        waits, as the gRPC front watches its caller). StopIteration after the final."""
        return self._next(timeout, True)

    def _next(self, timeout: float | None, polling: bool) -> StreamResponse | None:
        if not self._open:
            raise StopIteration
        try:
            got = self._engine.wait_stream(self._req, self._slot_off, timeout)
        except errors.ServerTimeoutError:
            if polling:
                return None
            self.close()
            raise
        except BaseException:  # server gone, interrupted: the request is cancelled
            self.close()
            raise
        status, message, results, stamps, index, final, empty = got
        if final:
            self._open = False
            try:
                if status != P.Status.OK:
                    raise self._error(status, message, results)
                if empty:  # the final flag alone: no response in it
                    raise StopIteration
                return self._response(status, message, results, stamps, index, True)
            finally:
                self._engine._alloc.free(self._req.block, self._req.block_bytes)
        try:
            return self._response(status, message, results, stamps, index, False)
        finally:
            self._engine._ops.hand_back(self._slot_off)

    def _error(self, status, message: str, results: list) -> errors.ShmServeError:
        if status == P.Status.OUTPUT_TOO_SMALL:
            message += (f" (needs {', '.join(str(r[3]) for r in results)} bytes; "
                        "infer_stream(output_bytes=...) sizes the output buffers)")
        return errors.from_status(status, message)

    def _response(self, status, message, results, stamps, index, final) -> StreamResponse:
        """A response's outputs copied out of the request's buffers (they are the next
        response's), or its error."""
        req = self._req
        plan = req.plan
        if status != P.Status.OK:
            return StreamResponse({}, stamps, plan.name, plan.version, index, final,
                                  self._error(status, message, results))
        begin, end = req.block, req.block + req.block_bytes
        arena = self._engine._arena.mmap
        names = plan.output_names
        arrays = {}
        for index_, dtype, offset, nbytes, shape in results:
            if index_ >= len(names) or offset < begin or offset + nbytes > end:
                raise errors.BadDescriptorError(f"model '{plan.name}': server answered with "
                                                "an output outside the buffers it was given")
            raw = np.frombuffer(arena, np.uint8, nbytes, offset)
            if dtype == P.DataType.BYTES:
                arr = P.decode_bytes(raw, shape)
            else:
                arr = raw.view(P.numpy_dtype(dtype)).reshape(shape).copy()
            arrays[names[index_]] = arr
        return StreamResponse(arrays, stamps, plan.name, plan.version, index, final)

    def stop(self) -> None:
        """Asks the model to stop (its is_cancelled() turns True) and keeps the request:
        the responses it still sends are dropped, and reading goes on until its final
        flag (StopIteration), after which slot and buffers are free. For a reader that
        must know when the slot is free (the gRPC front); call from the reading thread."""
        if self._open:
            self._engine._ops.cancel(self._slot_off)

    def cancel(self) -> None:
        """Asks the model to stop; no further response is read. The request's slot and
        buffers come back once the model sent its final flag."""
        self.close()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._engine.cancel_stream(self._req, self._slot_off)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AsyncResponseStream:
    """ResponseStream as an async iterator (Client.infer_stream_async): each wait for a
    response runs in the default executor, the event loop stays free."""

    def __init__(self, stream: ResponseStream):
        self._stream = stream

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamResponse:
        import asyncio
        done = object()
        got = await asyncio.get_running_loop().run_in_executor(None, next, self._stream, done)
        if got is done:
            raise StopAsyncIteration
        return got

    def cancel(self) -> None:
        self._stream.close()

    async def aclose(self) -> None:
        self._stream.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self._stream.close()
