"""Unit tests of the schedulers (shmserve.server.scheduling): the dynamic batching
rules, the default policy, default_queue_policy, and the interface a new policy
plugs into. Pure Python, no server."""
from __future__ import annotations

import dataclasses

import pytest

from shmserve.protocol import Status
from shmserve.server.scheduling import (POLICIES, CoreDefaultScheduler, CoreDynamicBatchScheduler,
                                        DefaultScheduler, DynamicBatchScheduler, Pending,
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
    # the plain queue policy in C; a queue timeout (or priorities) in Python
    assert type(make_scheduler(spec(dynamic=True))) is CoreDynamicBatchScheduler
    assert type(make_scheduler(spec(queue_timeout_us=5))) is DynamicBatchScheduler
    assert type(make_scheduler(spec(dynamic=False))) is CoreDefaultScheduler
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
    assert type(make_scheduler(spec(), policies)) is CoreDynamicBatchScheduler  # others unchanged
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
    assert stats["shmserve"]["batch_requests"] == {"1": 80}  # each request alone: 8 rows fill a batch


def test_bursts_to_a_python_queue_between_c_queued_requests_are_all_taken(server_factory):
    """The batcher's loop runs in C while no request is in a Python queue, and gives it
    back when its drain finds one (BatcherCore.serve). A request pushed between that
    drain and the next Python pass's look at the doorbell rang before that look: the
    pass must drain again, or the request waits for the model's 60 s queue delay (here:
    the watchdog). "held" batches in Python (priority levels), 4 rows a preferred batch;
    "plain" in C."""
    import numpy as np
    from helpers import IDENTITY_CODE, python_config, write_model

    def setup(repo):
        write_model(repo, "held", python_config("held", dynamic_batching=(
            "{ preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 60000000 "
            "priority_levels: 2 default_priority_level: 1 }")), IDENTITY_CODE)
        write_model(repo, "plain", python_config("plain"), IDENTITY_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    x = np.ones((1, 4), np.float32)
    for i in range(60):
        assert (c.infer("plain", {"INPUT0": x * i})["OUTPUT0"] == i).all()
        futures = [c.submit("held", {"INPUT0": x * k}, copy=True) for k in range(4)]
        assert [int(f.result(timeout=20)["OUTPUT0"][0, 0]) for f in futures] == [0, 1, 2, 3]


# -- instance balancing (issue 11): several idle instances share what is ready --------


def balancing(mode="balanced", **kw) -> ModelSpec:
    return dataclasses.replace(spec(**kw), instance_balancing=mode)


def sizes(batches) -> list[int]:
    return [sum(p.rows for p in b) for b in batches]


def singles(n, key=b"a", at_us=0):
    return [(1, key, at_us)] * n


def test_two_idle_instances_share_a_full_queue_in_balanced_batches():
    q = queue(balancing(max_batch=32, delay_us=10_000), *singles(32))
    batches, deadline = q.next_batches(0, 2)
    assert sizes(batches) == [16, 16] and deadline is None and len(q) == 0
    assert shadows(batches[0] + batches[1]) == list(range(32))  # arrival order kept


def test_greedy_gives_the_first_idle_instance_everything():
    q = queue(balancing("greedy", max_batch=32, delay_us=10_000), *singles(32))
    batches, deadline = q.next_batches(0, 2)
    assert sizes(batches) == [32] and deadline is None and len(q) == 0


def test_balancing_is_the_default():
    assert spec().instance_balancing == "balanced"
    q = queue(spec(max_batch=32, delay_us=0), *singles(32))
    assert sizes(q.next_batches(0, 2)[0]) == [16, 16]


@pytest.mark.parametrize("n, max_batch, idle, want", [
    (33, 32, 2, [17, 16]),
    (5, 32, 3, [2, 2, 1]),
    (40, 32, 2, [20, 20]),  # greedy: 32 and 8
    (3, 32, 4, [1, 1, 1]),  # never an empty batch: one instance stays idle
    (64, 32, 2, [32, 32]),
    (70, 32, 2, [32, 32]),  # more than two instances' share: the rest is greedy's too
])
def test_uneven_splits(n, max_batch, idle, want):
    q = queue(balancing(max_batch=max_batch, delay_us=0), *singles(n))
    batches, _ = q.next_batches(0, idle)
    assert sizes(batches) == want and len(q) == n - sum(want)
    g = queue(balancing("greedy", max_batch=max_batch, delay_us=0), *singles(n))
    assert len(g) - sum(sizes(g.next_batches(0, idle)[0])) == len(q)  # the same left behind


def test_balancing_only_splits_what_greedy_sends_now():
    """40 rows, max 32, a long queue delay: greedy sends the full 32 and holds 8 until
    the delay; balanced sends the same 32 to 3 idle instances (11 + 11 + 10) and holds
    the same 8 until the same deadline."""
    for mode, want in (("greedy", [32]), ("balanced", [11, 11, 10])):
        q = queue(balancing(mode, max_batch=32, delay_us=1000), *singles(40))
        batches, deadline = q.next_batches(10 * US, 3)
        assert sizes(batches) == want and deadline == 1000 * US
        assert shadows(q.queue) == list(range(32, 40))


def test_nothing_ready_means_no_batch_for_any_instance():
    q = queue(balancing(max_batch=32, delay_us=1000), *singles(20))
    assert q.next_batches(10 * US, 2) == ([], 1000 * US) and len(q) == 20


def test_one_idle_instance_gets_greedys_batch():
    q = queue(balancing(max_batch=32, delay_us=0), *singles(32))
    assert sizes(q.next_batches(0, 1)[0]) == [32]


def test_a_preferred_size_batch_is_not_split():
    q = queue(balancing(max_batch=32, delay_us=0, preferred=(32,)), *singles(32))
    assert sizes(q.next_batches(0, 2)[0]) == [32]
    q = queue(balancing(max_batch=8, delay_us=0, preferred=(4,)), *singles(6))
    assert sizes(q.next_batches(0, 2)[0]) == [4, 2]  # 4 kept; the rest balanced alone
    q = queue(balancing(max_batch=16, delay_us=0, preferred=(4, 8)), *singles(16))
    assert sizes(q.next_batches(0, 2)[0]) == [8, 8]


def test_shape_keys_never_mix_and_spare_instances_go_to_the_largest_share():
    reqs = [(1, b"a" if i % 6 else b"b", i) for i in range(12)]  # b at 0 and 6, a else
    q = queue(balancing(max_batch=32, delay_us=0), *reqs)
    batches, _ = q.next_batches(20 * US, 3)
    assert [{p.key for p in b} for b in batches] == [{b"b"}, {b"a"}, {b"a"}]
    assert sizes(batches) == [2, 5, 5] and len(q) == 0
    for b in batches:
        assert shadows(b) == sorted(shadows(b))


def test_multi_row_requests_are_split_within_max_batch_size():
    q = queue(balancing(max_batch=32, delay_us=0), (8, b"a", 0), (8, b"a", 0), (8, b"a", 0))
    assert sizes(q.next_batches(0, 2)[0]) == [16, 8]
    q = queue(balancing(max_batch=32, delay_us=0), (20, b"a", 0), (20, b"a", 0), (20, b"a", 0))
    batches, _ = q.next_batches(0, 2)  # one instance each; the third request waits
    assert sizes(batches) == [20, 20] and len(q) == 1


def test_every_policy_answers_next_batches():
    q = queue(spec(dynamic=False), *singles(2))
    batches, deadline = q.next_batches(0, 3)
    assert [shadows(b) for b in batches] == [[0], [1]] and deadline is None
    lifo = make_scheduler(spec(parameters={"test.policy": "lifo"}), (Lifo, *POLICIES))
    for i in range(3):
        lifo.enqueue(pending(i))
    assert [shadows(b) for b in lifo.next_batches(0, 2)[0]] == [[2], [1]] and len(lifo) == 1


def test_instance_balancing_parameter_is_read_and_checked(tmp_path):
    from helpers import IDENTITY_CODE, python_config, write_model

    from shmserve.errors import ConfigError
    from shmserve.server.repository import load_model

    def model(name, value):
        extra = ("" if value is None else 'parameters { key: "shmserve.instance_balancing" '
                 f'value {{ string_value: "{value}" }} }}')
        return write_model(tmp_path, name, python_config(name, extra=extra), IDENTITY_CODE)

    assert load_model(model("a", None))[0].instance_balancing == "balanced"
    assert load_model(model("b", "greedy"))[0].instance_balancing == "greedy"
    assert load_model(model("c", "Balanced"))[0].instance_balancing == "balanced"
    with pytest.raises(ConfigError) as e:
        load_model(model("d", "round-robin"))
    assert str(tmp_path / "d" / "config.pbtxt") in str(e.value)
    assert "shmserve.instance_balancing" in str(e.value) and "round-robin" in str(e.value)


# A python model of 2 instances whose every row answers [rows in its batch, its pid].
RECORDER_CODE = '''
import os
import numpy as np

class TritonPythonModel:
    def execute(self, inputs):
        n = len(inputs["INPUT0"])
        return {"OUTPUT0": np.tile(np.array([[n, os.getpid()]], np.int64), (n, 1))}
'''


@pytest.mark.parametrize("mode", ["balanced", "greedy"])
def test_a_burst_is_shared_by_two_idle_instances(server_factory, mode):
    """32 single-row requests at once on a model of 2 instances, max_batch_size 32 and a
    long queue delay: the batch goes when the 32nd arrives (full), both instances idle.
    Balanced, each instance gets 16; greedy (Triton), one gets all 32."""
    import numpy as np
    from helpers import python_config, wait_until, write_model

    def setup(repo):
        write_model(repo, "recorder", python_config(
            "recorder", "FP32", (-1,), max_batch_size=32, out_dtype="INT64", out_dims=(2,),
            dynamic_batching="{ max_queue_delay_microseconds: 5000000 }",
            extra='instance_group [ { count: 2 kind: KIND_CPU } ]\n'
                  f'parameters {{ key: "shmserve.instance_balancing" value {{ string_value: "{mode}" }} }}'),
            RECORDER_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client(arena_bytes=1 << 20)
    x = np.ones((1, 4), np.float32)
    for _ in range(3):
        # An instance answers its callers just before it marks itself idle: a burst sent
        # at once after the last answers could find one instance still busy.
        wait_until(lambda: all(i["state"] == "IDLE" for i in
                               c.statistics("recorder")[0]["shmserve"]["instances"]),
                   10, "both instances idle")
        futures = [c.submit("recorder", {"INPUT0": x}, copy=True) for _ in range(32)]
        rows = [tuple(f.result(timeout=30)["OUTPUT0"][0]) for f in futures]
        per_instance = {}
        for n, pid in rows:
            per_instance.setdefault(pid, set()).add(n)
        if mode == "balanced":
            assert len(per_instance) == 2 and all(v == {16} for v in per_instance.values())
        else:
            assert list(per_instance.values()) == [{32}]
    want = {"16": 6} if mode == "balanced" else {"32": 3}
    assert c.statistics("recorder")[0]["shmserve"]["batch_requests"] == want
