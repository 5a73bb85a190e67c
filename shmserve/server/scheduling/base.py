"""The scheduler interface: queue entries (Pending), Rejection, and Scheduler, the
base of every policy. The contract is in the package docstring (__init__.py)."""
from __future__ import annotations

import abc
import collections
import dataclasses
from typing import NamedTuple

from ...protocol import FailureReason, Status
from ..repository import ModelSpec


@dataclasses.dataclass(slots=True)
class Pending:
    """One validated request waiting in a scheduler (built by intake)."""
    shadow: int  # the request's shadow index: what a worker's mailbox names it by
    rows: int  # its batch dimension (1 for a model without batching)
    key: bytes  # its non-batch shapes: requests batch together only with an equal key
    arrived_ns: int  # when intake took it
    arena: object  # its client's arena mapping: opaque to a policy
    slot_off: int  # its slot in that arena: opaque to a policy
    generation: int = 0  # of the slot's request, to answer it
    priority: int = 0  # the request's priority option (0: the model's default level)
    timeout_us: int = 0  # its timeout option; once queued, the queue timeout that applies
    queue_index: int = -1  # FifoQueue: which of its queues holds it (-1: none)
    client: int = -1  # its client's id (lease index): fair share and per-client limits


class Rejection(NamedTuple):
    """A request a scheduler will not run, and the error to answer it with."""
    pending: Pending
    status: Status
    message: str
    reason: FailureReason = FailureReason.REJECTED  # queue full, timed out, stopping


class Scheduler(abc.ABC):
    """The policy of one model. See the module docstring for the contract."""
    pinned = False  # True: batches are for named instances (assign(), sequence.py)
    sequences = False  # True: its requests carry a correlation id (SequencePending)

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        # shmserve.max_queued_per_client (None: the server's --max-queued-per-client,
        # which the batcher sets); 0: no limit
        self.max_per_client = spec.max_queued_per_client or 0
        self.per_client: collections.Counter[int] = collections.Counter()  # only with a limit

    def admit(self, p: Pending) -> Rejection | None:
        """enqueue(p) within the per-client limit (intake's call)."""
        limit = self.max_per_client
        if not limit:
            return self.enqueue(p)
        if self.per_client[p.client] >= limit:
            return self.over_client_limit(p)
        refused = self.enqueue(p)
        if refused is None:
            self.per_client[p.client] += 1
        return refused

    def over_client_limit(self, p: Pending) -> Rejection:
        """The refusal of a request whose client has max_per_client queued already."""
        limit = self.max_per_client
        return Rejection(p, Status.BUSY, (
            f"model '{self.spec.name}': this client already has {limit} requests queued "
            f"(max_queued_per_client {limit}: --max-queued-per-client or the model "
            "parameter shmserve.max_queued_per_client); retry later"))

    def left(self, gone) -> None:
        """Requests that left the queue (a batch, a Rejection, drain()): the batcher's
        call, which keeps the per-client counts."""
        if self.max_per_client:
            counts = self.per_client
            for p in gone:
                counts[p.client] -= 1
                if counts[p.client] <= 0:
                    del counts[p.client]

    def sends_lone_request_at_once(self) -> bool:
        """Whether a request that finds the queue empty and an instance idle always goes
        at once, alone, whatever it is. Then the batcher may hand such a request over
        without asking the policy (csrc/batcher.c, set_direct): the common case of a
        quiet model costs no Python. False unless a policy knows better."""
        return False

    def join(self, batch: list[Pending], now_ns: int) -> list[Pending]:
        """Requests to add to `batch`, a batch handed to a busy instance as its next
        one and not started yet (the batcher's call; two batches deep), taken from the
        queue: Triton adds requests to a batch until an instance executes it. This
        default adds none (each request is its own batch)."""
        return []

    @classmethod
    @abc.abstractmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        """Whether this policy schedules the model spec describes (make_scheduler)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many requests it holds (enqueued, not yet returned)."""

    @abc.abstractmethod
    def enqueue(self, p: Pending) -> Rejection | None:
        """Takes p, or returns why not (intake answers it)."""

    @abc.abstractmethod
    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        """(batch, None) to run now; (None, deadline_ns) to wait until then at the
        latest; (None, None) when nothing can go before something new happens."""

    def next_batches(self, now_ns: int, idle: int) -> tuple[list[list[Pending]], int | None]:
        """Batches for `idle` idle instances at once (the batcher's call): at most `idle`
        of them, each to run now, and, when fewer than `idle`, the deadline of
        next_batch's (None, deadline) for the rest. This default asks next_batch once per
        instance (Triton's greedy rule); a policy that plans across instances (balancing)
        overrides it."""
        batches: list[list[Pending]] = []
        while len(batches) < idle:
            batch, deadline = self.next_batch(now_ns)
            if batch is None:
                return batches, deadline
            batches.append(batch)
        return batches, None

    @abc.abstractmethod
    def expire(self, now_ns: int) -> tuple[list[Rejection], int | None]:
        """The requests that waited too long, to answer, and when the next expires."""

    @abc.abstractmethod
    def drain(self) -> list[Pending]:
        """Every request held, removed: the model became unavailable."""
