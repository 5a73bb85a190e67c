"""The request-rate generator: constant and Poisson send times."""
import numpy as np
import pytest

from shmserve_bench.schedule import Schedule, WorkerSchedule, deal


def test_constant_schedule_is_evenly_spaced():
    s = Schedule(1000.0, "constant")
    t = s.next(5)
    assert t.tolist() == [0, 1_000_000, 2_000_000, 3_000_000, 4_000_000]
    assert s.next(2).tolist() == [5_000_000, 6_000_000]  # continues where it stopped


def test_constant_schedule_until():
    t = Schedule(250.0).until(2.0)
    assert len(t) == 500 and t[-1] == 1_996_000_000


def test_poisson_schedule_statistics():
    rate = 5000.0
    t = Schedule(rate, "poisson", seed=7).next(200_000)
    gaps = np.diff(t) / 1e9
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV = 1
    # counts per 10 ms bin: Poisson, variance = mean
    counts = np.bincount((t // 10_000_000).astype(int))[:-1]
    assert counts.mean() == pytest.approx(rate * 0.01, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


def test_poisson_schedule_is_deterministic_and_chunking_does_not_matter():
    a = Schedule(100.0, "poisson", seed=3)
    whole = Schedule(100.0, "poisson", seed=3).next(1000)
    parts = np.concatenate([a.next(1), a.next(499), a.next(500)])
    assert parts.tolist() == whole.tolist()
    assert Schedule(100.0, "poisson", seed=4).next(10).tolist() != whole[:10].tolist()


def test_deal_splits_one_schedule_over_workers():
    t = Schedule(1000.0, "poisson", seed=1).next(1001)
    shares = [deal(t, 3, i) for i in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == t.tolist()
    assert [len(s) for s in shares] == [334, 334, 333]


def test_worker_schedules_together_are_the_global_schedule():
    workers = [WorkerSchedule(2000.0, "constant", 0, 4, i, chunk=8) for i in range(4)]
    got = np.sort(np.concatenate([w.next_chunk() for w in workers for _ in range(2)]))
    assert got.tolist() == Schedule(2000.0).next(64).tolist()


def test_bad_arguments():
    with pytest.raises(ValueError):
        Schedule(0)
    with pytest.raises(ValueError):
        Schedule(10, "uniform")
