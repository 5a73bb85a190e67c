"""Sequence batching, Triton's rules (config `sequence_batching`, sequence_config.py).

A sequence is the requests that carry one correlation id (numeric or string) from a
request flagged START to one flagged END. Its first request gives it a batch slot on
one instance (the instance with the most free slots, its lowest free slot): every
request of the sequence goes to that instance, in arrival order, at most one per
batch, so the instance runs them one after the other and its worker keeps the
sequence's implicit state per slot (worker.py, server/sequence.py). An instance has
max_batch_size slots (direct; 1 for a model without batching) or
max_candidate_sequences (oldest). A START that finds no free slot waits in the
backlog, oldest first, until a sequence ends or is released.

- direct: a batch holds the head request of each slot of the instance, in slot order;
  the worker fills the slots in between with null rows (READY false), so a row of the
  batch is always the same sequence's. It goes when the slots with a request reach
  minimum_slot_utilization, or once the oldest has waited max_queue_delay_microseconds.
- oldest: a batch holds the head requests of the instance's candidate sequences, oldest
  first, up to max_batch_size (cut to a preferred_batch_size), by the dynamic batcher's
  rules (full, a preferred size, or the delay).

A sequence's slot is freed when its END request goes into a batch, or when it has
held it max_sequence_idle_microseconds with no request (released: a later request of
it without START is refused, as Triton does). Requests of a batch share their shapes.

The batcher calls assign() instead of next_batches() (Scheduler.pinned): a batch is
for one named instance, not for any idle one.
"""
from __future__ import annotations

import collections
import dataclasses

from ...protocol import SEQUENCE_END, SEQUENCE_START, DataType, Status
from ..repository import ModelSpec
from .base import Pending, Rejection, Scheduler


@dataclasses.dataclass(slots=True)
class SequencePending(Pending):
    """A request of a sequence model: its correlation id and flags."""
    corrid: int | str = 0
    flags: int = 0
    sequence_slot: int = -1  # set when it goes into a batch


class Sequence:
    """One live sequence: where it runs and what of it waits."""
    __slots__ = ("corrid", "instance", "slot", "queue", "last_ns")

    def __init__(self, corrid, instance: int, slot: int, now_ns: int):
        self.corrid, self.instance, self.slot = corrid, instance, slot
        self.queue: collections.deque[SequencePending] = collections.deque()
        self.last_ns = now_ns


def describe(corrid) -> str:
    return f"'{corrid}'" if isinstance(corrid, str) else str(corrid)


class SequenceScheduler(Scheduler):
    pinned = True
    sequences = True

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        seq = spec.sequence
        self.direct = seq["strategy"] == "direct"
        self.max_rows = max(spec.max_batch_size, 1)
        self.n_slots = self.max_rows if self.direct else max(seq["max_candidates"], 1)
        self.idle_ns = seq["idle_us"] * 1000
        self.delay_ns = seq["delay_us"] * 1000
        self.min_ready = seq["min_slot_utilization"] * self.n_slots
        self.preferred = seq["preferred"]
        corrid = seq["corrid"]
        self.string_ids = corrid is not None and corrid[1] == DataType.BYTES
        self.numeric_ids = corrid is not None and corrid[1] != DataType.BYTES
        self.instances = max(spec.instance_count, 1)
        # instance -> slot -> Sequence or None
        self.slots: list[list[Sequence | None]] = [[None] * self.n_slots
                                                   for _ in range(self.instances)]
        self.live: collections.OrderedDict[object, Sequence] = collections.OrderedDict()  # by last use
        self.backlog: collections.OrderedDict[object, collections.deque] = collections.OrderedDict()
        self.rejected: list[Rejection] = []  # refused while batching: answered by expire()
        self.count = 0

    @classmethod
    def applies_to(cls, spec: ModelSpec) -> bool:
        return spec.sequence is not None

    def __len__(self) -> int:
        return self.count

    # -- requests in --------------------------------------------------------------
    def enqueue(self, p: Pending) -> Rejection | None:
        name = self.spec.name
        corrid = getattr(p, "corrid", 0)
        if corrid == 0 or corrid == "":
            return Rejection(p, Status.INVALID_ARG, f"inference request to model '{name}' must "
                             "specify a non-zero or non-empty correlation ID")
        if self.numeric_ids and isinstance(corrid, str) or self.string_ids and isinstance(corrid, int):
            want, got = ("string", "unsigned integer") if self.string_ids else ("unsigned integer", "string")
            return Rejection(p, Status.INVALID_ARG, f"model '{name}': its CONTROL_SEQUENCE_CORRID "
                             f"takes a {want} correlation ID, the request gives a {got} "
                             f"({describe(corrid)})")
        if p.rows != 1:
            return Rejection(p, Status.INVALID_ARG, f"inference request to model '{name}' must "
                             "specify batch-size 1 due to requirements of sequence batcher")
        self.release_idle(p.arrived_ns)
        refused = self.route(p)
        if refused is None:
            self.count += 1
        return refused

    def route(self, p: SequencePending) -> Rejection | None:
        """Queues p behind its sequence (a START without a slot: in the backlog)."""
        corrid = p.corrid
        seq = self.live.get(corrid)
        if seq is not None:
            seq.queue.append(p)
            seq.last_ns = max(seq.last_ns, p.arrived_ns)
            self.live.move_to_end(corrid)
            return None
        waiting = self.backlog.get(corrid)
        if waiting is not None:
            waiting.append(p)
            return None
        if not p.flags & SEQUENCE_START:
            return Rejection(p, Status.INVALID_ARG, f"inference request for sequence "
                             f"{describe(corrid)} to model '{self.spec.name}' must specify the "
                             "START flag on the first request of the sequence")
        if not self.start(corrid, p.arrived_ns, [p]):
            self.backlog[corrid] = collections.deque([p])
        return None

    def start(self, corrid, now_ns: int, requests) -> bool:
        """Gives a new sequence a slot (the instance with most free slots, its lowest);
        False if none is free."""
        best, free_best = -1, 0
        for i, slots in enumerate(self.slots):
            free = slots.count(None)
            if free > free_best:
                best, free_best = i, free
        if best < 0:
            return False
        slot = self.slots[best].index(None)
        seq = Sequence(corrid, best, slot, now_ns)
        seq.queue.extend(requests)
        self.slots[best][slot] = seq
        self.live[corrid] = seq
        return True

    def free(self, seq: Sequence, now_ns: int) -> None:
        """The sequence leaves its slot; its requests still queued (the next sequence of
        that id) are routed anew, and the backlog takes the free slots."""
        self.slots[seq.instance][seq.slot] = None
        del self.live[seq.corrid]
        for p in seq.queue:
            refused = self.route(p)
            if refused is not None:
                self.rejected.append(refused)
        while self.backlog:
            corrid, waiting = next(iter(self.backlog.items()))
            if not self.start(corrid, now_ns, waiting):
                break
            del self.backlog[corrid]

    def release_idle(self, now_ns: int) -> None:
        """Releases the sequences that held a slot max_sequence_idle_microseconds with no
        request (least recently used first: the loop stops at the first one in use)."""
        for seq in list(self.live.values()):
            if now_ns - seq.last_ns < self.idle_ns:
                break
            if not seq.queue:
                self.free(seq, now_ns)

    def next_release(self) -> int | None:
        """When the next idle sequence is released (None: every one has requests)."""
        for seq in self.live.values():
            if not seq.queue:
                return seq.last_ns + self.idle_ns
        return None

    # -- batches out -----------------------------------------------------------------
    def next_batch(self, now_ns: int):
        raise TypeError("a sequence model's batches are for one instance each: use assign()")

    def assign(self, now_ns: int, idle: list[int]) -> tuple[list[tuple[int, list[Pending]]], int | None]:
        """Batches for the idle instances (their positions among the model's instances):
        [(instance, batch)], and the time by which to ask again (a delay that runs)."""
        plan, deadline = [], None
        for i in idle:
            heads = [(s, seq.queue[0]) for s, seq in enumerate(self.slots[i])
                     if seq is not None and seq.queue]
            if not heads:
                continue
            batch, wait_until = self.form(heads, now_ns)
            if batch is None:
                deadline = wait_until if deadline is None else min(deadline, wait_until)
                continue
            plan.append((i, batch))
        for _, batch in plan:
            self.count -= len(batch)
            for p in batch:
                seq = self.live[p.corrid]
                seq.queue.popleft()
                seq.last_ns = max(seq.last_ns, now_ns)
                self.live.move_to_end(p.corrid)
                if p.flags & SEQUENCE_END:
                    self.free(seq, now_ns)
        if self.rejected:  # requests after an END without START: expire() answers them next pass
            deadline = now_ns
        return plan, deadline

    def form(self, heads: list[tuple[int, SequencePending]], now_ns: int):
        """One instance's batch from its slots' head requests: (batch, None) to go now,
        (None, deadline) to wait."""
        oldest = min(heads, key=lambda h: h[1].arrived_ns)[1]
        same = [(s, p) for s, p in heads if p.key == oldest.key]  # shapes never mix
        expired = now_ns - oldest.arrived_ns >= self.delay_ns
        if self.direct:
            if not (expired or len(same) >= self.min_ready):
                return None, oldest.arrived_ns + self.delay_ns
        else:
            same.sort(key=lambda h: h[1].arrived_ns)
            same = same[:self.max_rows]
            top = self.preferred[-1] if self.preferred else self.max_rows
            if not (expired or len(same) >= top or len(same) >= self.max_rows):
                return None, oldest.arrived_ns + self.delay_ns
            cut = [n for n in self.preferred if n <= len(same)]
            if cut:
                same = same[:cut[-1]]
        for s, p in same:
            p.sequence_slot = s
        return [p for _, p in same], None

    # -- the rest of the contract --------------------------------------------------------
    def expire(self, now_ns: int) -> tuple[list[Rejection], int | None]:
        """Idle sequences released; requests refused while batching (a request after its
        sequence's END without START) answered."""
        self.release_idle(now_ns)
        rejected, self.rejected = self.rejected, []
        self.count -= len(rejected)
        return rejected, self.next_release()

    def drain(self) -> list[Pending]:
        drained = [p for seq in self.live.values() for p in seq.queue]
        drained += [p for waiting in self.backlog.values() for p in waiting]
        drained += [r.pending for r in self.rejected]
        self.live.clear()
        self.backlog.clear()
        self.rejected = []
        self.slots = [[None] * self.n_slots for _ in range(self.instances)]
        self.count = 0
        return drained
