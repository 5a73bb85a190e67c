"""The Future that Client.submit() returns: a concurrent.futures.Future that is cheaper
to make and to resolve.

The base class builds a Condition (a Python object over an RLock) for every future and
takes it in every method: about 6 us of a submitted request's CPU on a small machine,
a quarter of the Python client's work. Here a future has only its RLock (a C object),
held for a few attribute stores, and makes its Condition over it only when a thread
blocks in result() or exception(), or concurrent.futures.wait() or as_completed() take
it. Those and asyncio.wrap_future() work unchanged: they read `_state` and take
`_condition`. (One lock shared by every future would be cheaper still, but wait() and
as_completed() order the locks they take by future, which only prevents a deadlock
between two of them when each future has its own.)

cancel() is the caller giving up on the request: the engine stops waiting for it (the
server still runs it; its answer is dropped and its memory reclaimed when it comes),
as when infer()'s timeout passes.
"""
from __future__ import annotations

import _thread
import concurrent.futures
import threading
from concurrent.futures._base import (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, LOGGER,
                                      PENDING, RUNNING)

_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_CANCELLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))


class ResultFuture(concurrent.futures.Future):
    """A submitted request's future. on_cancel(future) runs after a successful cancel()."""

    def __init__(self, on_cancel=None):
        # No super().__init__(): it would build the Condition this class avoids.
        self._lock = _thread.RLock()  # threading.RLock()'s C lock, without its factory call
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiters = []
        self._done_callbacks = []
        self._cond = None
        self._on_cancel = on_cancel  # dropped once done: it holds the client's engine

    @property
    def _condition(self) -> threading.Condition:
        """The base class's and concurrent.futures.wait()'s lock, made on first use."""
        if self._cond is None:
            with self._lock:
                if self._cond is None:
                    self._cond = threading.Condition(self._lock)
        return self._cond

    # -- the engine's side -------------------------------------------------------------
    def resolve(self, result) -> bool:
        """set_result() unless the caller cancelled: False then, and the caller of
        resolve() disposes of `result`."""
        return self._finish(result, None)

    def fail(self, exception: BaseException) -> bool:
        """set_exception() unless the future is already done (cancelled): False then."""
        return self._finish(None, exception)

    def _finish(self, result, exception) -> bool:
        with self._lock:
            if self._state in _DONE:
                return False
            self._result, self._exception = result, exception
            self._state = FINISHED
            self._on_cancel = None
            if self._waiters or self._cond is not None:
                self._notify_locked("add_result" if exception is None else "add_exception")
        for callback in self._done_callbacks:  # _invoke_callbacks, inlined
            try:
                callback(self)
            except Exception:
                LOGGER.exception("exception calling callback for %r", self)
        return True

    def _notify_locked(self, how: str) -> None:
        for waiter in self._waiters:
            getattr(waiter, how)(self)
        if self._cond is not None:
            self._cond.notify_all()

    def set_result(self, result) -> None:
        if not self.resolve(result):
            raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")

    def set_exception(self, exception) -> None:
        if not self.fail(exception):
            raise concurrent.futures.InvalidStateError(f"{self._state}: {self!r}")

    def set_running_or_notify_cancel(self) -> bool:
        """As the base class's (for an executor's use); a cancel here is notified
        already, so a cancelled future answers False."""
        if self._state in _CANCELLED:
            return False
        return super().set_running_or_notify_cancel()

    # -- the caller's side: a finished future never changes, so no lock to read it ---
    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == RUNNING  # only after set_running_or_notify_cancel()

    def result(self, timeout=None):
        if self._state == FINISHED:
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # as the base class: no cycle through the traceback
            return self._result
        return super().result(timeout)

    def exception(self, timeout=None):
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if self._state not in _DONE:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:
            LOGGER.exception("exception calling callback for %r", self)

    def cancel(self) -> bool:
        """Cancels a request not yet answered. No executor runs these futures, so the
        cancel is notified here at once (CANCELLED_AND_NOTIFIED), for wait() and
        as_completed() to see it."""
        with self._lock:
            if self._state in (RUNNING, FINISHED):
                return False
            if self._state in _CANCELLED:
                return True
            self._state = CANCELLED_AND_NOTIFIED
            self._notify_locked("add_cancelled")
            on_cancel, self._on_cancel = self._on_cancel, None
        self._invoke_callbacks()
        if on_cancel is not None:
            on_cancel(self)
        return True
