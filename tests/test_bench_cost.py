"""shmserve_bench.cost: server CPU per request by role, from samples whose answers
are known (no server, no clock)."""
import os

import pytest

from shmserve_bench import cost as C

HZ = os.sysconf("SC_CLK_TCK")


def test_model_time_and_requests_read_either_statistics_shape():
    own = {"request_success": 90, "request_failure": 10, "compute_ns": 5_000}
    triton = {"inference_stats": {"success": {"count": 90, "ns": 1}, "fail": {"count": 10, "ns": 1},
                                  "compute_infer": {"count": 90, "ns": 5_000}}}
    for row in (own, triton):
        assert C.model_compute_ns(row) == 5_000
        assert C.model_requests(row) == 100
    assert C.model_compute_ns({"request_success": 1}) is None
    assert C.model_requests({"compute_ns": 1}) is None


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
    s = C.ServerSampler(os.getpid(), stats=lambda: {"request_success": 3, "compute_ns": 7})
    sample = s.sample()
    assert sample.ticks[os.getpid()][0] == "coordinator"
    assert (sample.requests, sample.compute_ns) == (3, 7)
    whole = C.ServerSampler(os.getpid(), by_role=False).sample()
    assert {role for role, _ in whole.ticks.values()} == {"server"}
