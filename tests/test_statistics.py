"""Issue 13: Triton's statistics extension (client.statistics, `shmserve stats`), and
the latency histograms behind the summaries and `shmserve status`."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import RAISER_CODE, python_config, write_model

from shmserve import _core, errors
from shmserve.server import statistics

DURATION = {"count", "ns"}
INFERENCE_STATS = {"success", "fail", "queue", "compute_input", "compute_infer",
                   "compute_output", "cache_hit", "cache_miss"}
MODEL_STAT = {"name", "version", "last_inference", "inference_count", "execution_count",
              "inference_stats", "response_stats", "batch_stats", "memory_usage", "shmserve"}


def test_buckets_hold_their_values():
    low, high = statistics.bucket_bounds()
    rng = np.random.default_rng(7)
    values = np.concatenate([np.arange(0, 300), rng.integers(0, 2**41, 3000),
                             [2**k for k in range(1, 40)], [2**k - 1 for k in range(1, 40)]])
    for v in values.tolist():
        b = _core.latency_bucket(v)
        if b < statistics.BUCKETS - 1:  # the last bucket also holds everything beyond it
            assert low[b] <= v < high[b], (v, b, low[b], high[b])
            assert high[b] - low[b] <= max(1.0, low[b] / 8), (v, b)


def test_quantiles_within_a_bucket_of_the_truth():
    rng = np.random.default_rng(3)
    samples = rng.lognormal(np.log(50_000), 0.6, 20_000).astype(np.int64)
    counts = np.zeros(statistics.BUCKETS)
    for v in samples.tolist():
        counts[_core.latency_bucket(v)] += 1
    qs = [0.5, 0.9, 0.99, 0.999]
    for q, got in zip(qs, statistics.quantiles(counts, qs)):
        want = float(np.quantile(samples, q))
        assert abs(got - want) <= 0.07 * want, (q, got, want)
    assert statistics.quantiles(np.zeros(statistics.BUCKETS), [0.5]) == [None]


def setup_models(repo) -> None:
    write_model(repo, "raiser", python_config("raiser", "FP32", (-1,)), RAISER_CODE)


def test_statistics_in_tritons_shape(server_factory):
    server = server_factory(models=("simple",), setup=setup_models)
    client = server.client(arena_bytes=1 << 20)
    t0 = int(time.time() * 1000)
    ok = np.ones((2, 4), np.float32)
    for _ in range(4):
        client.infer("raiser", [ok])
    with pytest.raises(errors.InternalError):
        client.infer("raiser", [-ok])
    every = client.statistics()
    assert {(s["name"], s["version"]) for s in every} == {("simple", "1"), ("raiser", "1")}
    (st,) = client.statistics("raiser")
    assert [(s["name"], s["version"]) for s in client.statistics("raiser", 1)] == [("raiser", "1")]
    assert set(st) == MODEL_STAT
    assert set(st["inference_stats"]) == INFERENCE_STATS
    assert all(set(d) == DURATION for d in st["inference_stats"].values())
    inf = st["inference_stats"]
    assert inf["success"]["count"] == 4 and inf["fail"]["count"] == 1
    assert st["inference_count"] == 10 and st["execution_count"] == 5
    # compute stages count every request of every execution, the failed one included
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[stage]["count"] == 5 and inf[stage]["ns"] > 0, stage
    # every request was alone in its execution: its time from the batcher's take to its
    # answer holds its execution's three stages
    assert (inf["success"]["ns"] + inf["fail"]["ns"]
            >= sum(inf[k]["ns"] for k in ("compute_input", "compute_infer", "compute_output")))
    assert inf["cache_hit"] == inf["cache_miss"] == {"count": 0, "ns": 0}
    (batch,) = st["batch_stats"]  # every execution had 2 rows
    assert batch["batch_size"] == 2 and batch["compute_infer"]["count"] == 5
    assert batch["compute_infer"]["ns"] == inf["compute_infer"]["ns"]  # one request a batch
    assert t0 <= st["last_inference"] <= int(time.time() * 1000) + 1
    (mem,) = st["memory_usage"]
    assert mem["type"] == "CPU" and mem["id"] == 0 and mem["byte_size"] > 1 << 20
    own = st["shmserve"]
    assert own["state"] == "READY" and own["pending"] == 0
    assert own["failures"]["BACKEND"] == 1
    (inst,) = own["instances"]
    assert inst["state"] == "IDLE" and inst["executions"] == 5 and inst["restarts"] == 0
    assert "histograms" not in own
    (st,) = client.statistics("raiser", histograms=True)
    hist = st["shmserve"]["histograms"]
    assert sum(c for _, c in hist["success"]) == 4 and sum(c for _, c in hist["fail"]) == 1
    p50 = statistics.quantiles(statistics.dense(hist["compute_infer"]), [0.5])[0]
    assert 0 < p50 <= inf["compute_infer"]["ns"]

    with pytest.raises(errors.ModelNotFoundError, match="nope"):
        client.statistics("nope")
    with pytest.raises(errors.ModelNotFoundError, match="version 7"):
        client.statistics("raiser", 7)

    # `shmserve stats --json` prints the extension's response; the table its figures
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "stats", "--json", "--name",
                        server.name, "--model", "raiser"],
                       capture_output=True, text=True, timeout=60, env=server.env())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (cli,) = doc["model_stats"]
    assert set(cli) == MODEL_STAT - {"shmserve"}  # as Triton answers it
    # Triton's own schema (tritonclient's grpc protos) takes it field for field
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2

    parsed = json_format.ParseDict(doc, service_pb2.ModelStatisticsResponse())
    assert parsed.model_stats[0].inference_stats.success.count == 4
    assert parsed.model_stats[0].batch_stats[0].batch_size == 2
    assert cli["inference_stats"]["success"]["count"] == 4
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "stats", "--name", server.name],
                       capture_output=True, text=True, timeout=60, env=server.env())
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:] if line.strip()}
    assert lines["raiser"][2] == "4" and lines["raiser"][3] == "1", r.stdout
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "stats", "--name", server.name,
                        "--model", "nope"], capture_output=True, text=True, timeout=60,
                       env=server.env())
    assert r.returncode != 0 and "nope" in r.stderr, r.stderr
