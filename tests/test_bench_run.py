"""A short `shmserve bench` against a real server: well-formed CSV / JSON / PNG,
errors counted and reported. Nothing here asserts on time."""
import csv
import json
import subprocess
import sys

import numpy as np
import pytest

import helpers
from shmserve_bench import BenchConfig, report, run_benchmark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK = ["-p", "250", "--warmup", "0.2", "-r", "3", "-s", "100"]


def raiser_repo(repo):
    helpers.write_model(repo, "raiser", helpers.python_config("raiser", "FP32", (-1,)),
                        helpers.RAISER_CODE)


@pytest.fixture
def bench_server(server_factory):
    return server_factory(models=("identity",), setup=raiser_repo)


def test_cli_run_writes_csv_json_png(bench_server, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shmserve.cli", "bench", "-m", "identity", "--name",
           bench_server.name, "--shape", "INPUT0:256", "--concurrency-range", "1:3:2",
           "--processes", "2", *QUICK, "-f", str(out / "r.csv"), "--json", str(out / "r.json"),
           "--plot", str(out / "plots")]
    out.mkdir()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=bench_server.env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "where the time goes" in r.stdout and "compute (model)" in r.stdout

    rows = list(csv.DictReader((out / "r.csv").open()))
    assert [row["Concurrency"] for row in rows] == ["1", "3"]
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
        assert 0 < float(row["p50 latency"]) <= float(row["p99 latency"]) <= float(row["p99.9 latency"])
        assert row["Errors"] == "0"
        assert float(row["compute (model) p50"]) > 0

    doc = json.loads((out / "r.json").read_text())
    (target,) = doc["results"]
    assert target["model"] == "identity" and target["error"] is None
    levels = target["levels"]
    assert [lv["value"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["summary"]["n"] > 0 and lv["summary"]["errors"] == 0
        assert 1 <= len(lv["windows"]) <= 3
        assert lv["processes"] == (1 if lv["value"] == 1 else 2)
        assert lv["client_cpu_pct"] is not None and lv["server_cpu_pct"] is not None
        stages = {b["stage"] for b in lv["breakdown"]}
        assert "enqueued -> dequeued (batcher wakes)" in stages
        # the server saw what the harness sent (warm-up and stop included)
        assert lv["server_stats"]["request_success"] >= lv["summary"]["n"]

    for name in ("latency_vs_throughput.png", "latency_cdf.png"):
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_errors_are_counted_and_reported(bench_server, tmp_path):
    """The raiser model fails every request holding a negative value: a data file
    alternating good and bad requests gives errors and successes, both counted."""
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [{"INPUT0": [1.0, 2.0, 3.0]},
                                         {"INPUT0": [-1.0, 2.0, 3.0]}]}))
    cfg = BenchConfig(model="raiser", url=f"shm://{bench_server.name}", input_data=str(data),
                      concurrency=[1, 2], measurement_interval_s=0.25, warmup_s=0.2,
                      max_trials=3, stability_pct=100.0,
                      target_options={"socket_path": str(bench_server.socket_path)})
    results = run_benchmark(cfg)
    (tr,) = results
    assert tr.error is None
    for lv in tr.levels:
        s = lv.summary
        assert s["n"] > 0 and s["errors"] > 0
        if lv.value == 1:  # every other request fails (batched together, a bad one fails both)
            assert abs(s["errors"] - s["n"]) <= 2
        (msg,) = lv.errors_total
        assert "boom: negative input" in msg
        assert lv.errors_total[msg] >= s["errors"]
    text = report.table(results)
    assert "boom: negative input" in text
    rows = list(csv.DictReader(report.csv_text(results).splitlines()))
    assert all(int(r["Errors"]) > 0 for r in rows)


def test_request_rate_mode_and_a_dead_target(bench_server, tmp_path):
    cfg = BenchConfig(model="identity", url=f"shm://{bench_server.name}",
                      compare=["shm://no-such-server"], shapes={"INPUT0": [16]},
                      request_rate=[300.0], distribution="poisson", processes=2,
                      measurement_interval_s=0.3, warmup_s=0.2, max_trials=3,
                      stability_pct=100.0)
    results = run_benchmark(cfg)
    live, dead = results
    (lv,) = live.levels
    assert lv.mode == "rate" and lv.summary["n"] > 0 and lv.summary["errors"] == 0
    assert lv.send_lag_us is not None and lv.latencies_us is not None
    # open loop: intended times follow the schedule, so offered load ~ 300/s
    assert lv.summary["n"] == pytest.approx(300 * lv.measured_s, rel=0.5)
    assert dead.error and "no-such-server" in dead.error and not dead.levels
    report.write_json(results, tmp_path / "r.json", config=cfg)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["results"][1]["error"]
    assert np.isfinite(doc["results"][0]["levels"][0]["summary"]["latency_us"]["p99"])


@pytest.mark.timeout(120)
def test_levels_cut_by_duration_report_cpu(bench_server, tmp_path):
    """Issue 13: over several levels with --duration, a level cut to one window
    reported client and server CPU as 0 (the CPU marks for the start of window 1
    were taken at its end). A share of --duration too short for more than a window
    or two per level; every level measured must give CPU figures over its windows,
    the server's split by role, with the model's time taken out."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "shmserve.cli", "bench", "-m", "identity", "--name",
           bench_server.name, "--shape", "INPUT0:256", "--concurrency-range", "1,2",
           "-p", "500", "--warmup", "0.2", "--duration", "2", "--json", str(out), "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=bench_server.env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "server CPU per request (1): coordinator" in r.stdout
    levels = json.loads(out.read_text())["results"][0]["levels"]
    assert levels and all(lv["windows"] for lv in levels)
    for lv in levels:
        if len(lv["windows"]) < 3:
            assert "time bound" in lv["note"] and "stable result needs 3" in lv["note"]
        assert lv["client_cpu_pct"] > 0 and lv["client_cpu_us_per_request"] > 0
        assert lv["server_cpu_pct"] > 0 and lv["server_cpu_us_per_request"] > 0
        roles = lv["server_cpu_us_by_role"]
        assert {"coordinator", "batcher", "workers"} <= set(roles)
        assert all(v >= 0 for v in roles.values())
        assert sum(roles.values()) == pytest.approx(lv["server_cpu_us_per_request"])
        assert lv["model_us_per_request"] > 0  # identity's execute took some time
        assert lv["server_overhead_us_per_request"] == pytest.approx(
            lv["server_cpu_us_per_request"] - lv["model_us_per_request"])


@pytest.mark.timeout(120)
def test_one_window_level_cpu_covers_that_window(bench_server):
    """The same, without --duration: a level of a single window (-r 1), through the
    library; the client processes report the end of the warm-up, where window 1's
    client CPU starts."""
    cfg = BenchConfig(model="identity", url=f"shm://{bench_server.name}",
                      shapes={"INPUT0": [16]}, concurrency=[1, 3], processes=2,
                      measurement_interval_s=0.5, warmup_s=0.2, max_trials=1,
                      target_options={"socket_path": str(bench_server.socket_path)})
    (tr,) = run_benchmark(cfg)
    assert tr.error is None and len(tr.levels) == 2
    for lv in tr.levels:
        assert len(lv.windows) == 1 and lv.summary["n"] > 0
        assert lv.client_cpu_pct > 0 and lv.client_cpu_us_per_request > 0
        assert lv.server_cpu_pct > 0 and lv.server_cpu_us_per_request > 0
        assert lv.server_cpu_us_by_role["workers"] > 0
