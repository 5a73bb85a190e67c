"""shmserve_bench.stats against distributions whose answers are known."""
import math

import numpy as np
import pytest

from shmserve_bench import stats as S


def test_percentiles_of_a_uniform_grid_are_exact():
    v = np.arange(0, 100001)  # 0..100000: the q-th percentile is 1000 * q
    p = S.percentiles(v)
    assert p == pytest.approx({"p50": 50000.0, "p90": 90000.0, "p95": 95000.0, "p99": 99000.0,
                               "p99.9": 99900.0}, abs=1e-6)


@pytest.mark.parametrize("q", [50, 90, 99, 99.9])
def test_percentiles_of_an_exponential_sample(q):
    lam = 1 / 200.0  # mean 200 us
    v = np.random.default_rng(1).exponential(1 / lam, 400_000)
    expected = -math.log(1 - q / 100) / lam
    assert S.percentiles(v, (q,))[S.pkey(q)] == pytest.approx(expected, rel=0.03)


def test_percentiles_of_a_normal_sample():
    v = np.random.default_rng(2).normal(100.0, 10.0, 400_000)
    p = S.percentiles(v, (50, 97.5))
    assert p["p50"] == pytest.approx(100.0, abs=0.1)
    assert p["p97.5"] == pytest.approx(100.0 + 1.95996 * 10.0, abs=0.2)


def test_percentiles_of_nothing_are_nan():
    assert all(math.isnan(x) for x in S.percentiles([]).values())


def records(n, start_ns=0, gap_ns=1000, latency_ns=500, ok=1):
    r = np.zeros((n, S.N_COLS), np.int64)
    r[:, S.INTENDED] = r[:, S.SENT] = start_ns + np.arange(n) * gap_ns
    r[:, S.END] = r[:, S.SENT] + latency_ns
    r[:, S.OK] = ok
    return r


def test_summarize_throughput_latency_and_errors():
    good = records(1000, latency_ns=2000)
    bad = records(10, ok=0)
    s = S.summarize(np.concatenate([good, bad]), seconds=0.5)
    assert s["throughput"] == pytest.approx(2000.0)  # successes per second only
    assert s["n"] == 1000 and s["errors"] == 10
    assert s["latency_us"]["p50"] == pytest.approx(2.0)
    assert s["latency_us"]["mean"] == pytest.approx(2.0)


def test_latency_is_measured_from_the_intended_time():
    r = records(10, latency_ns=1000)
    r[:, S.SENT] += 5000  # sent late: the wait counts (no coordinated omission)
    r[:, S.END] += 5000
    assert (S.latency_ns(r) == 6000).all()


def test_window_membership_by_completion_time():
    r = records(100, gap_ns=10, latency_ns=0)  # ends at 0, 10, ..., 990
    assert len(S.in_window(r, 0, 500)) == 50
    assert len(S.in_window(r, 500, 1000)) == 50
    assert len(S.in_window(r, 995, 2000)) == 0


def test_within_and_stability():
    assert S.within([100, 105, 95], 10)
    assert not S.within([100, 125, 95], 10)
    assert S.within([0, 0, 0], 10)
    assert not S.within([], 10)
    w = lambda tp, lat: {"throughput": tp, "latency_us": {"mean": lat, "p99": lat * 3}}
    assert not S.is_stable([w(100, 10), w(100, 10)], 10)  # fewer than 3 windows
    assert S.is_stable([w(50, 99), w(100, 10), w(101, 10.5), w(99, 9.8)], 10)
    assert not S.is_stable([w(100, 10), w(100, 10), w(150, 10)], 10)  # throughput moved
    assert not S.is_stable([w(100, 10), w(100, 10), w(100, 13)], 10)  # latency moved
    assert S.is_stable([w(100, 10), w(100, 10), w(100, 10.5)], 10, latency_key="p99")


def test_stability_on_windows_of_a_stationary_process():
    """Windows of the same Poisson load agree within 10 %; a load that doubles does not."""
    rng = np.random.default_rng(3)
    def window(rate):
        n = rng.poisson(rate)
        r = records(n)
        r[:, S.END] = r[:, S.SENT] + rng.exponential(100_000, n).astype(np.int64)
        return S.summarize(r, 1.0)
    assert S.is_stable([window(20000) for _ in range(3)], 10)
    assert not S.is_stable([window(20000), window(20000), window(40000)], 10)


def test_breakdown_of_stamped_requests():
    n = 1000
    r = records(n, start_ns=10**9, latency_ns=0)
    t = r[:, S.SENT].copy()
    stage_ns = [1000, 200, 3000, 400, 5000, 6000, 700, 800, 900]  # call->write ... wake->return
    for i, d in enumerate(stage_ns[:8]):
        t = t + d
        r[:, S.STAMP0 + i] = t
    r[:, S.END] = t + stage_ns[8]
    rows = S.breakdown(r)
    assert [row["stage"] for row in rows] == [label for label, *_ in S.STAGES[1:]]
    assert [row["p50"] for row in rows] == pytest.approx([d / 1000 for d in stage_ns])
    assert rows[0]["n"] == n


def test_breakdown_skips_unstamped_stages_and_failed_requests():
    r = records(10)
    assert S.breakdown(r) == []  # a KServe target stamps nothing
    r[:, S.OK] = 0
    r[:, S.STAMP0:] = 1
    assert S.breakdown(r) == []


def test_cdf_is_monotone_and_ends_at_the_max():
    v = np.random.default_rng(4).exponential(1.0, 50_000)
    x, q = S.cdf(v)
    assert len(x) <= 401 and (np.diff(x) >= 0).all() and (np.diff(q) > 0).all()
    assert q[0] == 0 and q[-1] == 1 and x[-1] == v.max()
