"""Unit tests of the dynamic batching rules (batcher.ModelQueue), no server."""
from __future__ import annotations

from shmserve.server.batcher import ModelQueue, Pending
from shmserve.server.repository import ModelSpec, TensorSpec

US = 1000  # ns


def spec(max_batch=8, delay_us=100, preferred=(), dynamic=True) -> ModelSpec:
    t = TensorSpec("INPUT0", 11, (-1,))
    return ModelSpec(name="m", version=1, backend="python", path="/x", max_batch_size=max_batch,
                     inputs=(t,), outputs=(TensorSpec("OUTPUT0", 11, (-1,)),), instance_count=1,
                     dynamic_batching=dynamic, preferred_batch_sizes=tuple(preferred),
                     max_queue_delay_us=delay_us, parameters={}, config_text="")


def queue(s: ModelSpec, *requests) -> ModelQueue:
    """requests: (rows, key, arrived_us)."""
    q = ModelQueue(0, s, [0])
    for i, (rows, key, at) in enumerate(requests):
        q.queue.append(Pending(i, rows, key, at * US, None, 0))
    return q


def shadows(batch) -> list[int]:
    return [p.shadow for p in batch]


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
