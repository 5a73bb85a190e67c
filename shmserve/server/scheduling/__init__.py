"""Schedulers: which validated requests of one model run together, and when.

The batcher process holds one scheduler per model, chosen from its ModelSpec by
make_scheduler(). A scheduler is a policy over queue entries (Pending) and nothing
else; the batcher's loop (batcher.py) and its intake (intake.py) do all the rest.

Who calls what: everything runs in the batcher process, on its one thread, so a
policy needs no locks.

- intake.Intake.take() validates a request at the trust boundary, builds its Pending
  (Pending.client: its client's id) and calls admit(p) on the scheduler of its model:
  the base class refuses it over the per-client limit (max_queued_per_client), else
  calls the policy's enqueue(p). A Rejection returned (e.g. a full queue: BUSY) is
  answered by intake; None means the scheduler now holds p. The batcher calls left()
  with every request a scheduler gives back (batches, Rejections, drain()), which
  keeps the per-client counts.
- batcher.Batcher.dispatch(), on every pass of the loop, for each model that holds
  requests (len(scheduler) > 0):
    1. drain() if the model became unavailable (its instances crash-looped): every
       request held is returned and the batcher answers each UNAVAILABLE;
    2. expire(now_ns): requests that waited too long come back as Rejections, with
       the time of the next expiry (or None); the batcher answers them;
    3. next_batches(now_ns, idle) once, idle being how many of its instance workers
       are idle: up to `idle` batches, each handed to one of them, and, when fewer,
       a deadline: a time means wait, and the loop runs again by then without being
       rung; None means nothing can go until something happens (a new request, a
       worker going idle). The base class answers it with next_batch(now_ns) once per
       idle instance until that returns no batch ((batch, None) or (None, deadline)),
       Triton's greedy rule; a policy that plans across instances overrides it
       (dynamic.py balances the batches, unless shmserve.instance_balancing is greedy).
  A scheduler is only asked again when the loop runs: on a doorbell (a new request,
  an idle worker), on the earliest deadline it returned, or on the idle tick.

Rules for a policy:
- It never touches shared memory: Pending.arena and Pending.slot_off are handles the
  batcher answers and dispatches with, opaque to a policy. It never answers a request
  itself; it returns Rejections, which Intake.reject() answers.
- Every Pending enqueued leaves exactly once: in one batch, in one Rejection, or in
  drain(). One lost is a caller left waiting; one returned twice is answered twice.
- It never blocks or sleeps: it returns a deadline instead.
- A batch is a non-empty list of Pending that may run as one execution: same non-batch
  shapes (equal Pending.key), at most max(max_batch_size, 1) rows in all and at most
  MAX_BATCH_REQUESTS requests (the mailbox's capacity).
- now_ns and Pending.arrived_ns are the same monotonic clock (shmserve._core.now_ns).
- Fair share (issue 14): a policy with queues (fifo.py) lets clients take turns within a
  priority level (fair.py), each client's requests in arrival order.

The common cases in C: a model with one priority level and no queue timeout, with
dynamic batching or the default policy (core_queue.py), keeps its queue in C
(csrc/batch_queue.c), with dynamic.py's, default.py's and fair.py's rules. The batcher's C core fills it from the ring and hands its batches
over itself (BatcherCore.set_queue, dispatch); the Scheduler methods above see the
same queue, for what intake queues itself and for the tests.

A new policy (ensembles) is a new module with a Scheduler subclass whose
applies_to(spec) recognises its models, listed in POLICIES before the default.

Sequence batching (sequence.py) is pinned (Scheduler.pinned): a sequence's requests
must reach one instance, so the batcher calls assign(now_ns, idle_instances) instead
of next_batches() and gets (instance, batch) pairs; intake builds its requests as
SequencePending (correlation id and flags).
"""
from __future__ import annotations

from typing import Sequence

from ..repository import ModelSpec
from .base import Pending, Rejection, Scheduler
from .default import DefaultScheduler
from .dynamic import DynamicBatchScheduler
from .core_queue import CoreDefaultScheduler, CoreDynamicBatchScheduler, CoreQueue
from .sequence import SequencePending, SequenceScheduler

__all__ = ["Pending", "Rejection", "Scheduler", "POLICIES", "make_scheduler",
           "CoreDefaultScheduler", "CoreDynamicBatchScheduler", "CoreQueue", "DefaultScheduler", "DynamicBatchScheduler", "SequencePending", "SequenceScheduler"]

# Tried in order; the first whose applies_to(spec) is true schedules the model.
POLICIES: tuple[type[Scheduler], ...] = (SequenceScheduler, CoreDynamicBatchScheduler,
                                         DynamicBatchScheduler, CoreDefaultScheduler,
                                         DefaultScheduler)


def make_scheduler(spec: ModelSpec, policies: Sequence[type[Scheduler]] = POLICIES) -> Scheduler:
    """The scheduler of a model: the first policy that applies to its spec."""
    for policy in policies:
        if policy.applies_to(spec):
            return policy(spec)
    raise ValueError(f"model '{spec.name}': no scheduling policy applies")
