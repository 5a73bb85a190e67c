"""Unit tests of the schedulers (shmserve.server.scheduling): the dynamic batching
rules, the default policy, default_queue_policy, and the interface a new policy
plugs into. Pure Python, no server."""
from __future__ import annotations

import pytest

from shmserve.protocol import Status
from shmserve.server.scheduling import (POLICIES, DefaultScheduler, DynamicBatchScheduler, Pending,
                                        Rejection, Scheduler, make_scheduler)
from shmserve.server.repository import ModelSpec, TensorSpec

US = 1000  # ns


def spec(max_batch=8, delay_us=100, preferred=(), dynamic=True, max_queue_size=0,
         queue_timeout_us=0, parameters=None) -> ModelSpec:
    t = TensorSpec("INPUT0", 11, (-1,))
    return ModelSpec(name="m", version=1, backend="python", path="/x", max_batch_size=max_batch,
                     inputs=(t,), outputs=(TensorSpec("OUTPUT0", 11, (-1,)),), instance_count=1,
                     dynamic_batching=dynamic, preferred_batch_sizes=tuple(preferred),
                     max_queue_delay_us=delay_us, parameters=parameters or {}, config_text="",
                     max_queue_size=max_queue_size, queue_timeout_us=queue_timeout_us)


def pending(i: int, rows=1, key=b"a", at_us=0) -> Pending:
    return Pending(i, rows, key, at_us * US, None, 0)


def queue(s: ModelSpec, *requests) -> Scheduler:
    """requests: (rows, key, arrived_us)."""
    q = make_scheduler(s)
    for i, (rows, key, at) in enumerate(requests):
        assert q.enqueue(pending(i, rows, key, at)) is None
    return q


def shadows(batch) -> list[int]:
    return [p.shadow for p in batch]


# -- dynamic batching (Triton's rules) ------------------------------------------


def test_waits_for_the_queue_delay_then_sends_what_is_there():
    q = queue(spec(delay_us=100), (1, b"a", 0), (1, b"a", 10))
    batch, deadline = q.next_batch(50 * US)
    assert batch is None and deadline == 100 * US
    batch, _ = q.next_batch(100 * US)
    assert shadows(batch) == [0, 1] and not q.queue


def test_zero_delay_sends_at_once():
    q = queue(spec(delay_us=0), (1, b"a", 0))
    assert shadows(q.next_batch(0)[0]) == [0]


def test_full_batch_goes_without_waiting():
    q = queue(spec(max_batch=4, delay_us=10_000), (2, b"a", 0), (2, b"a", 0), (1, b"a", 0))
    batch, _ = q.next_batch(1)
    assert shadows(batch) == [0, 1] and shadows(q.queue) == [2]


def test_preferred_size_is_cut_from_a_larger_queue():
    q = queue(spec(max_batch=8, delay_us=10_000, preferred=(2, 4)),
              *[(1, b"a", 0)] * 5)
    batch, _ = q.next_batch(1)
    assert len(batch) == 4 and len(q.queue) == 1


def test_shapes_never_mix_and_order_is_kept():
    q = queue(spec(delay_us=0), (1, b"a", 0), (1, b"b", 0), (1, b"a", 0), (1, b"b", 0))
    assert shadows(q.next_batch(0)[0]) == [0, 2]
    assert shadows(q.queue) == [1, 3]
    assert shadows(q.next_batch(0)[0]) == [1, 3]


def test_without_dynamic_batching_one_request_per_execution():
    q = queue(spec(dynamic=False), (1, b"a", 0), (1, b"a", 0))
    assert shadows(q.next_batch(0)[0]) == [0]


# -- the policies through the interface ---------------------------------------


def test_the_factory_chooses_the_policy_from_the_spec():
    assert type(make_scheduler(spec(dynamic=True))) is DynamicBatchScheduler
    assert type(make_scheduler(spec(dynamic=False))) is DefaultScheduler
    assert POLICIES[-1] is DefaultScheduler  # the fallback comes last


def test_default_policy_runs_one_request_at_a_time_in_arrival_order():
    q = queue(spec(dynamic=False, max_batch=8, delay_us=10_000),
              (1, b"a", 0), (3, b"b", 0), (1, b"a", 5))
    assert len(q) == 3
    sent = [q.next_batch(0) for _ in range(3)]
    assert [shadows(batch) for batch, _ in sent] == [[0], [1], [2]]
    assert all(deadline is None for _, deadline in sent)  # never waits for company
    assert len(q) == 0 and q.next_batch(0) == (None, None)
    assert q.expire(10**12) == ([], None) and q.drain() == []


def test_dynamic_policy_expires_requests_past_the_queue_timeout():
    q = queue(spec(delay_us=1_000_000, queue_timeout_us=100), (1, b"a", 0), (1, b"b", 30), (1, b"a", 60))
    assert q.expire(99 * US) == ([], 100 * US)
    expired, next_expiry = q.expire(130 * US)
    assert shadows(r.pending for r in expired) == [0, 1]
    assert {r.status for r in expired} == {Status.UNAVAILABLE}
    assert "timed out in the queue after 100 us" in expired[0].message
    assert next_expiry == 160 * US and shadows(q.queue) == [2]
    expired, next_expiry = q.expire(10**9)
    assert shadows(r.pending for r in expired) == [2] and next_expiry is None and len(q) == 0


def test_without_a_queue_timeout_nothing_expires():
    q = queue(spec(delay_us=1_000_000), (1, b"a", 0))
    assert q.expire(10**15) == ([], None) and len(q) == 1


def test_dynamic_policy_refuses_past_max_queue_size_with_busy():
    q = queue(spec(max_queue_size=2), (1, b"a", 0), (1, b"a", 0))
    refused = q.enqueue(pending(2))
    assert isinstance(refused, Rejection) and refused.pending.shadow == 2
    assert refused.status == Status.BUSY and "max_queue_size 2" in refused.message
    assert shadows(q.queue) == [0, 1]
    q.next_batch(10**9)  # a batch leaves: room again
    assert q.enqueue(pending(3)) is None and shadows(q.queue) == [3]


def test_drain_returns_everything_held_once():
    q = queue(spec(delay_us=1_000_000), (1, b"a", 0), (1, b"b", 0))
    assert shadows(q.drain()) == [0, 1]
    assert len(q) == 0 and q.drain() == [] and q.next_batch(10**12) == (None, None)


class Lifo(Scheduler):
    """A policy the tree does not ship: newest first, one at a time, for models whose
    config names it; to show that a policy is a class, not an edit of the batcher."""

    @classmethod
    def applies_to(cls, s: ModelSpec) -> bool:
        return s.parameters.get("test.policy") == "lifo"

    def __init__(self, s: ModelSpec):
        super().__init__(s)
        self.stack: list[Pending] = []

    def __len__(self) -> int:
        return len(self.stack)

    def enqueue(self, p: Pending) -> Rejection | None:
        self.stack.append(p)
        return None

    def next_batch(self, now_ns: int):
        return ([self.stack.pop()], None) if self.stack else (None, None)

    def expire(self, now_ns: int):
        return [], None

    def drain(self) -> list[Pending]:
        drained, self.stack = self.stack, []
        return drained


def test_a_custom_policy_plugs_in_through_the_interface():
    policies = (Lifo, *POLICIES)
    q = make_scheduler(spec(parameters={"test.policy": "lifo"}), policies)
    assert isinstance(q, Lifo)
    assert type(make_scheduler(spec(), policies)) is DynamicBatchScheduler  # others unchanged
    for i in range(3):
        assert q.enqueue(pending(i)) is None
    assert len(q) == 3 and shadows(q.next_batch(0)[0]) == [2]
    assert shadows(q.drain()) == [0, 1] and len(q) == 0


def test_a_policy_must_implement_the_whole_interface():
    class Partial(Scheduler):
        @classmethod
        def applies_to(cls, s):
            return True

        def next_batch(self, now_ns):
            return None, None

    with pytest.raises(TypeError):
        make_scheduler(spec(), (Partial,))


def test_no_applicable_policy_is_an_error():
    with pytest.raises(ValueError, match="no scheduling policy"):
        make_scheduler(spec(), (Lifo,))


def test_burst_from_one_caller_is_not_held_by_a_timer(server_factory):
    """Issue 11's bug: 4 requests of 8 rows on `simple` (max_batch_size 8, one instance)
    submitted at once. The instance gets the first batch while it is idle; the rest must
    follow as soon as it goes idle again (the worker rings the batcher), not on the
    batcher's idle tick. The tick is set to 10 minutes here, so a backlog held by it
    would trip the watchdog instead of passing slowly."""
    import numpy as np

    server = server_factory(models=("simple",), args=["--idle-check-ms", "600000"])
    c = server.client(arena_bytes=1 << 20)
    a = np.ones((8, 16), np.int32)
    for _ in range(20):
        futures = [c.submit("simple", {"INPUT0": a, "INPUT1": a}, copy=True) for _ in range(4)]
        for f in futures:
            assert (f.result(timeout=30)["OUTPUT0"] == 2).all()
    stats = c.statistics("simple")[0]
    assert stats["batch_requests"] == {"1": 80}  # each request alone: 8 rows fill a batch
