"""FifoQueue: the base of the policies that hold queues in arrival order, with Triton's
queue policies: priority_levels (1 = highest) and default_priority_level, and per level
(priority_queue_policy, else default_queue_policy) max_queue_size,
default_timeout_microseconds, timeout_action (REJECT or DELAY) and
allow_timeout_override. Subclasses decide next_batch (and may override next_batches to
plan across idle instances, as dynamic.py does).

Order: the requests of level 1, then those of level 1 that timed out with DELAY, then
level 2, and so on (Triton's PriorityQueue); within each, the clients take turns, each
client's requests in arrival order (fair.py: a caller with many requests queued does
not put another's one behind all of them; with one client it is arrival order). A request's
priority 0, or one above priority_levels, is the model's default level, as in Triton.
Timeouts: Triton's rule, a request's own timeout_us counts only where its level allows
the override and only if it is shorter than the level's default_timeout_microseconds.

Cost: a model with one level and no DELAY iterates one FairQueue; without a timeout,
expire() returns at once. Deadlines live in a heap only when some level has a timeout
or allows one."""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable, NamedTuple

from ...protocol import Status
from ..repository import ModelSpec
from .base import Pending, Rejection, Scheduler
from .fair import FairQueue


class QueuePolicy(NamedTuple):
    """Triton's ModelQueuePolicy of one priority level."""
    max_queue_size: int = 0  # 0: unbounded (the slots bound it anyway)
    timeout_us: int = 0  # default_timeout_microseconds; 0: none
    delay: bool = False  # timeout_action DELAY (else REJECT)
    allow_override: bool = False  # allow_timeout_override


def queue_policies(spec: ModelSpec) -> list[QueuePolicy]:
    """One policy per priority level (index 0 = level 1)."""
    default = QueuePolicy(spec.max_queue_size, spec.queue_timeout_us,
                          spec.queue_delay_on_timeout, spec.allow_timeout_override)
    per_level = {level: QueuePolicy(*rest) for level, *rest in spec.priority_queue_policies}
    return [per_level.get(level, default) for level in range(1, max(spec.priority_levels, 1) + 1)]


class FifoQueue(Scheduler):
    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.policies = queue_policies(spec)
        self.default_level = max(spec.default_priority_level, 1) - 1 if spec.priority_levels else 0
        # Per level its queue, then its delayed requests: the order batches take them in.
        self.queues: list[FairQueue] = [FairQueue() for _ in range(2 * len(self.policies))]
        self.count = 0
        self.n_levels = len(self.policies)
        self.timed = any(p.timeout_us or p.allow_override for p in self.policies)
        # One level that never DELAYs uses queues[0] alone: the common case, kept cheap.
        self.simple = self.n_levels == 1 and not self.policies[0].delay
        self.deadlines: list[tuple[int, int, Pending]] = []  # heap: (deadline_ns, seq, p)
        self.seq = itertools.count()

    def __len__(self) -> int:
        return self.count

    def plain_queue(self) -> bool:
        """One priority level, no timeout, no per-client limit: order is arrival order
        alone (and turns, which a lone request does not take)."""
        return self.simple and not self.timed and not self.max_per_client

    @property
    def queue(self) -> list[Pending]:
        """Every request held, in the order batches take them (for tests and tools)."""
        return list(self.ordered())

    def ordered(self) -> Iterable[Pending]:
        """The requests held in the order batches take them."""
        if self.simple:
            return self.queues[0]
        return itertools.chain.from_iterable(self.queues)

    def head(self) -> Pending | None:
        """The request the next batch starts with."""
        for q in self.queues:
            if q:
                return q.head()
        return None

    def oldest(self) -> Pending | None:
        """The request of the model that has waited longest, whoever its client."""
        return min((q.oldest() for q in self.queues if q), key=lambda p: p.arrived_ns,
                   default=None)

    def enqueue(self, p: Pending) -> Rejection | None:
        # Triton: priority 0, or above priority_levels, is the default level.
        level = p.priority - 1 if 0 < p.priority <= self.n_levels else self.default_level
        policy = self.policies[level]
        q = self.queues[2 * level]
        limit = policy.max_queue_size
        if limit and len(q) + len(self.queues[2 * level + 1]) >= limit:
            return Rejection(p, Status.BUSY, f"model '{self.spec.name}': queue is full "
                             f"(max_queue_size {limit}); retry later")
        q.append(p)
        self.count += 1
        p.queue_index = 2 * level
        if self.timed:
            timeout_us = policy.timeout_us
            if policy.allow_override and p.timeout_us and (p.timeout_us < timeout_us):
                timeout_us = p.timeout_us
            if timeout_us:
                p.timeout_us = timeout_us  # the one that applies, for the message
                heapq.heappush(self.deadlines, (p.arrived_ns + timeout_us * 1000, next(self.seq), p))
        return None

    def take(self, picked: list[Pending]) -> None:
        """Removes the requests of a batch (in the order ordered() gave them): each
        uses its client's turn."""
        self.count -= len(picked)
        for p in picked:
            self.queues[p.queue_index].remove(p, served=True)
            p.queue_index = -1  # its deadline in the heap, if any, is stale from now on

    def expire(self, now_ns: int) -> tuple[list[Rejection], int | None]:
        """Requests past their queue timeout: REJECT answers them (Triton's "Request
        timeout expired"), DELAY moves them behind the other requests of their level."""
        heap = self.deadlines
        if not heap:
            return [], None
        expired = []
        while heap and (heap[0][0] <= now_ns or heap[0][2].queue_index < 0):
            _, _, p = heapq.heappop(heap)
            k = p.queue_index
            if k < 0:
                continue  # it left in a batch
            level = k // 2
            self.queues[k].remove(p, served=False)
            if self.policies[level].delay:
                p.queue_index = k + 1
                self.queues[k + 1].append(p)
                continue
            p.queue_index = -1
            self.count -= 1
            expired.append(Rejection(p, Status.UNAVAILABLE, (
                f"Request timeout expired (model '{self.spec.name}': timed out in the queue "
                f"after {p.timeout_us} us, priority level {level + 1})")))
        return expired, (heap[0][0] if heap else None)

    def drain(self) -> list[Pending]:
        drained = list(self.ordered())
        for q in self.queues:
            q.clear()
        for p in drained:
            p.queue_index = -1
        self.count = 0
        self.deadlines.clear()
        return drained
