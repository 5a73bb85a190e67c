"""Dynamic batching, Triton's rules: a batch is the oldest request and the later ones
of the same non-batch shapes, up to max_batch_size rows; it goes when full, when a
preferred_batch_size can be cut from it, or once its oldest request has waited
max_queue_delay_microseconds. default_queue_policy comes from FifoQueue."""
from __future__ import annotations

import collections

from ...protocol import MAX_BATCH_REQUESTS
from ..repository import ModelSpec
from .base import Pending
from .fifo import FifoQueue


class DynamicBatchScheduler(FifoQueue):
    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.max_rows = max(spec.max_batch_size, 1)
        self.delay_ns = spec.max_queue_delay_us * 1000
        self.preferred = spec.preferred_batch_sizes  # sorted by the repository

    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return spec.dynamic_batching

    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        """Returns (batch, None) when a batch should go now, or (None, deadline_ns)
        when it is worth waiting for more requests until deadline_ns."""
        if not self.queue:
            return None, None
        head = self.queue[0]
        picked, rows, preferred_prefix = [], 0, 0
        skipped = more = False
        for p in self.queue:
            if p.key != head.key:  # different shapes never share a batch
                skipped = skipped or bool(picked)
                continue
            if rows + p.rows > self.max_rows or len(picked) == MAX_BATCH_REQUESTS:
                more = True
                break
            picked.append(p)
            rows += p.rows
            if rows in self.preferred:
                preferred_prefix = len(picked)
        full = more or rows >= self.max_rows
        expired = now_ns - head.arrived_ns >= self.delay_ns
        if preferred_prefix and (full or expired or rows >= self.preferred[-1]):
            picked = picked[:preferred_prefix]
        elif not (full or expired):
            return None, head.arrived_ns + self.delay_ns
        if not skipped:  # the batch is the head of the queue: the common case
            for _ in picked:
                self.queue.popleft()
        else:
            taken = {id(p) for p in picked}
            self.queue = collections.deque(p for p in self.queue if id(p) not in taken)
        return picked, None
