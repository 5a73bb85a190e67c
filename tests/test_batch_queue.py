"""The common policies' queue in C (csrc/batch_queue.c, scheduling/core_queue.py)
against the Python policies it stands for (dynamic.py and default.py over fifo.py and
fair.py): the same operations, in random order, give the same batches, deadlines and
queues. Pure Python, no server."""
from __future__ import annotations

import random

import pytest

from shmserve.protocol import MAX_BATCH_REQUESTS, Status
from shmserve.server.repository import ModelSpec, TensorSpec
from shmserve.server.scheduling import (CoreDefaultScheduler, CoreDynamicBatchScheduler,
                                        DefaultScheduler, DynamicBatchScheduler, Pending)

US = 1000


def spec(max_batch=8, delay_us=100, preferred=(), max_queue_size=0, dynamic=True) -> ModelSpec:
    t = TensorSpec("INPUT0", 11, (-1,))
    return ModelSpec(name="m", version=1, backend="python", path="/x", max_batch_size=max_batch,
                     inputs=(t,), outputs=(TensorSpec("OUTPUT0", 11, (-1,)),), instance_count=1,
                     dynamic_batching=dynamic, preferred_batch_sizes=tuple(preferred),
                     max_queue_delay_us=delay_us, parameters={}, config_text="",
                     max_queue_size=max_queue_size)


def both(s: ModelSpec, max_per_client=0):
    if s.dynamic_batching:
        core, python = CoreDynamicBatchScheduler(s), DynamicBatchScheduler(s)
    else:
        core, python = CoreDefaultScheduler(s), DefaultScheduler(s)
    core.max_per_client = python.max_per_client = max_per_client
    return core, python


def twins(i, rows, key, at, client):
    """One request as each implementation gets it (each keeps its own Pending)."""
    return [Pending(i, rows, key, at, None, 8 * i, generation=i % 7, client=client)
            for _ in range(2)]


def shadows(batch):
    return None if batch is None else [p.shadow for p in batch]


def answer(result):
    """A Rejection's status and message, or None."""
    return None if result is None else (result.status, result.message, result.pending.shadow)


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_give_the_same_answers(seed):
    """Seeds 0-29 dynamic batching, 30-39 the default policy (one request a batch)."""
    rnd = random.Random(seed)
    s = spec(max_batch=rnd.choice([1, 4, 8, 64]), delay_us=rnd.choice([0, 100, 1000]),
             preferred=rnd.choice([(), (2,), (2, 4)]), max_queue_size=rnd.choice([0, 0, 12]),
             dynamic=seed < 30)
    core, python = both(s, max_per_client=rnd.choice([0, 0, 5]))
    keys = [b"a", b"b", b"x" * 40]  # the last is longer than the inline key
    now, shadow, nexts = 0, 0, []  # nexts: batches handed as next batches, to join
    for _ in range(300):
        now += rnd.randrange(0, 60) * US
        op = rnd.random()
        if op < 0.55:
            rows = min(rnd.choice([1, 1, 1, 2, 3]), s.max_batch_size)  # intake's check
            c, p = twins(shadow, rows, rnd.choice(keys), now,
                         rnd.randrange(4))
            shadow += 1
            assert answer(core.admit(c)) == answer(python.admit(p))
        elif op < 0.8:
            (cb, cd), (pb, pd) = core.next_batch(now), python.next_batch(now)
            assert (shadows(cb), cd) == (shadows(pb), pd)
            if pb:
                python.left(pb)
                nexts.append((cb, pb))
        elif op < 0.95 and nexts:
            cb, pb = nexts[-1]
            cj, pj = core.join(cb, now), python.join(pb, now)
            assert shadows(cj) == shadows(pj)
            python.left(pj)
            cb += cj
            pb += pj
        assert shadows(core.queue) == shadows(python.queue)
        assert len(core) == len(python)
        assert (core.sends_lone_request_at_once() == python.sends_lone_request_at_once())
    assert shadows(core.drain()) == shadows(python.drain())
    assert len(core) == 0 and core.next_batch(now) == (None, None)


def test_a_request_comes_back_as_the_pending_queued_and_fields_survive_the_c_queue():
    core = CoreDynamicBatchScheduler(spec(delay_us=0))
    queued = Pending(5, 2, b"k" * 50, 123, None, 4096, generation=9, priority=1,
                     timeout_us=77, client=3)
    core.enqueue(queued)
    batch, deadline = core.next_batch(10**9)
    assert batch == [queued] and batch[0] is queued and deadline is None


def test_limits_refuse_with_triton_s_words():
    core = CoreDynamicBatchScheduler(spec(max_queue_size=2))
    core.max_per_client = 1
    assert core.admit(Pending(0, 1, b"a", 0, None, 0, client=1)) is None
    refused = core.admit(Pending(1, 1, b"a", 0, None, 0, client=1))
    assert refused.status == Status.BUSY and "already has 1 requests queued" in refused.message
    assert core.admit(Pending(2, 1, b"a", 0, None, 0, client=2)) is None
    refused = core.admit(Pending(3, 1, b"a", 0, None, 0, client=3))
    assert refused.status == Status.BUSY and "max_queue_size 2" in refused.message
    assert core.core_queue.room(4) is False and core.core_queue.client_count(1) == 1


def test_a_batch_stops_at_the_mailbox_capacity():
    core = CoreDynamicBatchScheduler(spec(max_batch=4 * MAX_BATCH_REQUESTS, delay_us=0))
    for i in range(MAX_BATCH_REQUESTS + 3):
        core.enqueue(Pending(i, 1, b"a", 0, None, 0))
    batch, _ = core.next_batch(1)
    assert len(batch) == MAX_BATCH_REQUESTS and len(core) == 3


def test_clients_take_turns():
    core = CoreDynamicBatchScheduler(spec(max_batch=4, delay_us=0))
    for i in range(6):  # client 1 floods first, then client 2 sends two
        core.enqueue(Pending(i, 1, b"a", i, None, 0, client=1 if i < 4 else 2))
    assert shadows(core.next_batch(10)[0]) == [0, 4, 1, 5]
    assert shadows(core.queue) == [2, 3]


def test_the_default_policy_sends_one_request_a_batch_whatever_its_rows():
    core = CoreDefaultScheduler(spec(dynamic=False, max_batch=4))
    for i, rows in enumerate((4, 1, 3)):
        core.enqueue(Pending(i, rows, b"a", 0, None, 0))
    assert [shadows(core.next_batch(0)[0]) for _ in range(3)] == [[0], [1], [2]]
    assert core.next_batch(0) == (None, None)
    core.enqueue(Pending(3, 1, b"a", 0, None, 0))
    batch, _ = core.next_batch(0)
    core.enqueue(Pending(4, 1, b"a", 0, None, 0))
    assert core.join(batch, 0) == []  # a batch is one request: nothing joins it
