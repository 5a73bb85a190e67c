"""shmserve_bench.cost: server CPU per request by role, from samples whose answers
are known (no server, no clock)."""
import os

import pytest

from shmserve_bench import cost as C

HZ = os.sysconf("SC_CLK_TCK")


def stats_row(success: int, fail: int, executions: dict) -> dict:
    """A statistics row (Triton's extension shape); executions: batch size -> (count, ns)."""
    return {"inference_stats": {"success": {"count": success, "ns": 1},
                                "fail": {"count": fail, "ns": 1},
                                "compute_infer": {"count": success + fail, "ns": 10**9}},
            "batch_stats": [{"batch_size": size, "compute_infer": {"count": n, "ns": ns}}
                            for size, (n, ns) in executions.items()]}


def test_model_time_is_per_execution_not_per_request():
    # compute_infer.ns sums over requests (a batch of 4 counts 4 times); the model's
    # own time is the executions' sum, from batch_stats
    row = stats_row(90, 10, {1: (20, 1_000), 4: (20, 4_000)})
    assert C.model_compute_ns(row) == 5_000
    assert C.model_requests(row) == 100
    assert C.model_compute_ns({"name": "x"}) is None
    assert C.model_requests({"name": "x"}) is None


def test_roles_from_the_command_line():
    py = "/usr/bin/python3"
    assert C.role_of([py, "-m", "shmserve.server.batcher"]) == "batcher"
    assert C.role_of([py, "-m", "shmserve.server.worker"]) == "workers"
    assert C.role_of([py, "-c", "shmserve.server.worker"]) == "other"
    assert C.role_of([]) == "other"


def test_cost_by_role_less_the_model():
    a = C.Sample(at_ns=0, requests=1_000, compute_ns=0,
                 ticks={10: ("coordinator", 5), 11: ("batcher", 100), 12: ("workers", 200),
                        13: ("workers", 7), 14: ("workers", 50)})  # 14 ends in between
    b = C.Sample(at_ns=2_000_000_000, requests=1_000 + HZ, compute_ns=HZ * 3_000,
                 ticks={10: ("coordinator", 5), 11: ("batcher", 120), 12: ("workers", 230),
                        13: ("workers", 7), 15: ("workers", 4)})  # 15 starts in between
    c = C.server_cost(a, b)
    per_tick_us = 1e6 / HZ / HZ  # one clock tick spread over HZ requests
    assert c["requests"] == HZ
    assert c["us_per_request"] == pytest.approx({"coordinator": 0.0, "batcher": 20 * per_tick_us,
                                                 "workers": 34 * per_tick_us})
    assert list(c["us_per_request"]) == ["coordinator", "batcher", "workers"]
    assert c["total_us"] == pytest.approx(54 * per_tick_us)
    assert c["model_us"] == pytest.approx(3.0)
    assert c["overhead_us"] == pytest.approx(54 * per_tick_us - 3.0)
    assert c["cpu_s"] == pytest.approx(54 / HZ)
    assert c["cpu_pct"] == pytest.approx(100 * 54 / HZ / 2.0)


def test_cost_without_statistics_divides_by_the_given_requests():
    a = C.Sample(at_ns=0, ticks={1: ("server", 0)})
    b = C.Sample(at_ns=10**9, ticks={1: ("server", HZ)})  # one CPU second
    c = C.server_cost(a, b, requests=1_000)
    assert c["us_per_request"] == {"server": pytest.approx(1_000.0)}
    assert c["model_us"] is None and c["overhead_us"] is None
    assert C.server_cost(a, b) is None  # nothing to divide by
    assert C.server_cost(a, C.Sample(at_ns=10**9), requests=10) is None  # no process


def test_sampler_sees_this_process_tree():
    s = C.ServerSampler(os.getpid(), stats=lambda: stats_row(3, 0, {1: (3, 7)}))
    sample = s.sample()
    assert sample.ticks[os.getpid()][0] == "coordinator"
    assert (sample.requests, sample.compute_ns) == (3, 7)
    whole = C.ServerSampler(os.getpid(), by_role=False).sample()
    assert {role for role, _ in whole.ticks.values()} == {"server"}
