"""The common policies with their queue in C (csrc/batch_queue.c): dynamic batching
with the plain queue policy, and the default policy (one request a batch). Most models
are one of these, and the batcher's hot path serves them with no Python per request.

The rules are dynamic.py's, default.py's and fair.py's, for a model whose queue has one
priority level and no queue timeout (max_queue_size and the per-client limit are
kept) and, with dynamic batching, no instance balancing to do (one instance, or
instance_balancing greedy). The batcher hands such a model's queue to its C core
(BatcherCore.set_queue): requests go from the ring into the queue and from the queue
into mailboxes in C. These classes are the same queue seen as a Scheduler: what intake
queues itself (a request whose arena was mapped late, or whose options were checked),
a failing model's drain, and the unit tests, which hold the C queue and the Python
policies to the same answers (tests/test_batch_queue.py).
"""
from __future__ import annotations

from ..._core import BatchQueue
from ...protocol import MAX_BATCH_REQUESTS, Status
from ..repository import BALANCED, ModelSpec
from .base import Pending, Rejection
from .default import DefaultScheduler
from .dynamic import DynamicBatchScheduler

NO_ROW_LIMIT = 2**31  # the default policy sends the first request whatever its rows


def plain_queue_policy(spec: ModelSpec) -> bool:
    """One priority level, no queue timeout (nor override), no preserve_ordering."""
    return (spec.priority_levels <= 1 and not spec.priority_queue_policies
            and not spec.queue_timeout_us and not spec.allow_timeout_override
            and not spec.queue_delay_on_timeout and not spec.preserve_ordering)


class CoreQueue:
    """The Scheduler methods over a BatchQueue (self.core_queue), for the policies
    below; their own class supplies the rest (sends_lone_request_at_once, next_batches)."""
    core_queue: BatchQueue
    spec: ModelSpec

    # The per-client limit lives in the C queue (the batcher sets it after __init__).
    @property
    def max_per_client(self) -> int:
        return self.core_queue.max_per_client

    @max_per_client.setter
    def max_per_client(self, limit: int) -> None:
        self.core_queue.max_per_client = limit

    def __len__(self) -> int:
        return len(self.core_queue)

    def ordered(self):
        return self.core_queue.ordered()

    def head(self) -> Pending | None:
        ordered = self.core_queue.ordered()
        return ordered[0] if ordered else None

    def oldest(self) -> Pending | None:
        return min(self.core_queue.ordered(), key=lambda p: p.arrived_ns, default=None)

    def admit(self, p: Pending) -> Rejection | None:
        limit = self.max_per_client
        if limit and self.core_queue.client_count(p.client) >= limit:
            return self.over_client_limit(p)
        return self.enqueue(p)

    def enqueue(self, p: Pending) -> Rejection | None:
        limit = self.spec.max_queue_size
        if limit and len(self.core_queue) >= limit:
            return Rejection(p, Status.BUSY, f"model '{self.spec.name}': queue is full "
                             f"(max_queue_size {limit}); retry later")
        self.core_queue.push(p)
        return None

    def left(self, gone) -> None:
        pass  # the C queue counts each client's requests itself

    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        return self.core_queue.next_batch(now_ns)

    def join(self, batch: list[Pending], now_ns: int) -> list[Pending]:
        return self.core_queue.join(batch)

    def expire(self, now_ns: int) -> tuple[list[Rejection], int | None]:
        return [], None  # no queue timeout: applies_to

    def drain(self) -> list[Pending]:
        return self.core_queue.drain()


class CoreDynamicBatchScheduler(CoreQueue, DynamicBatchScheduler):
    def __init__(self, spec: ModelSpec):
        self.core_queue = BatchQueue(Pending, max(spec.max_batch_size, 1), spec.max_queue_delay_us,
                                     tuple(spec.preferred_batch_sizes), spec.max_queue_size)
        super().__init__(spec)

    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return (spec.dynamic_batching and plain_queue_policy(spec)
                and (spec.instance_count == 1 or spec.instance_balancing != BALANCED)
                and len(spec.preferred_batch_sizes) <= MAX_BATCH_REQUESTS)


class CoreDefaultScheduler(CoreQueue, DefaultScheduler):
    def __init__(self, spec: ModelSpec):
        # one request a batch, whatever its rows; no delay; clients in turns
        self.core_queue = BatchQueue(Pending, NO_ROW_LIMIT, 0, (), spec.max_queue_size, 1)
        super().__init__(spec)

    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return not spec.dynamic_batching and plain_queue_policy(spec)
