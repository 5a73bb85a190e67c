"""FifoQueue: the base of the policies that hold one queue in arrival order, with
Triton's default_queue_policy (max_queue_size, default_timeout_microseconds with
REJECT). Subclasses decide next_batch (and may override next_batches to plan across
idle instances, as dynamic.py does)."""
from __future__ import annotations

import collections

from ...protocol import Status
from ..repository import ModelSpec
from .base import Pending, Rejection, Scheduler


class FifoQueue(Scheduler):
    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.queue: collections.deque[Pending] = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def enqueue(self, p: Pending) -> Rejection | None:
        limit = self.spec.max_queue_size  # 0: unbounded (the slots bound it anyway)
        if limit and len(self.queue) >= limit:
            return Rejection(p, Status.BUSY, f"model '{self.spec.name}': queue is full "
                             f"(max_queue_size {limit}); retry later")
        self.queue.append(p)
        return None

    def expire(self, now_ns: int) -> tuple[list[Rejection], int | None]:
        """The queue is in arrival order: only its head can be the next to expire."""
        timeout_us = self.spec.queue_timeout_us
        if not timeout_us:
            return [], None
        timeout_ns = timeout_us * 1000
        expired = []
        while self.queue and now_ns - self.queue[0].arrived_ns >= timeout_ns:
            expired.append(Rejection(self.queue.popleft(), Status.UNAVAILABLE,
                                     f"model '{self.spec.name}': request timed out in the queue "
                                     f"after {timeout_us} us (default_queue_policy)"))
        return expired, (self.queue[0].arrived_ns + timeout_ns if self.queue else None)

    def drain(self) -> list[Pending]:
        drained = list(self.queue)
        self.queue.clear()
        return drained
