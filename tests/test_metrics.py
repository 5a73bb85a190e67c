"""Issue 13: the Prometheus endpoint (--metrics-port) in Triton's families, read back
with prometheus_client's parser, and the `shmserve models` table (full state,
success and failure counts). Each test has a server of its own (server_factory)."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers import BROKEN_INIT_CODE, RAISER_CODE, python_config, wait_until, write_model
from prometheus_client.parser import text_string_to_metric_families

from shmserve import errors

N_OK, N_FAIL = 5, 3


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_models(repo) -> None:
    write_model(repo, "raiser", python_config("raiser", "FP32", (-1,)), RAISER_CODE)
    write_model(repo, "broken", python_config("broken", "FP32", (-1,)), BROKEN_INIT_CODE)


def send_requests(client) -> None:
    """N_OK successful requests and N_FAIL failing ones to 'raiser' (its execute()
    raises on a negative input: failures the server counts), one at a time so that
    no failing request shares a batch with a successful one; one refused request
    to the UNAVAILABLE 'broken'."""
    ok = np.ones((1, 4), np.float32)
    for _ in range(N_OK):
        np.testing.assert_array_equal(client.infer("raiser", [ok], copy=True)["OUTPUT0"], ok)
    for _ in range(N_FAIL):
        with pytest.raises(errors.InternalError, match="boom"):
            client.infer("raiser", [-ok])
    with pytest.raises(errors.UnavailableError):
        client.infer("broken", [ok], timeout=20)


def scrape(port: int) -> tuple[str, str]:
    """(content type, text) of /metrics; waits for the endpoint (it starts after the
    control socket)."""
    def get():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return r.headers["Content-Type"], r.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return None

    return wait_until(get, 30, f"the metrics endpoint on port {port}")


def by_key(fam) -> dict:
    return {(s.labels["model"], s.labels["version"]): s.value for s in fam.samples}


def test_metrics_exposition_parses_as_triton_families(server_factory):
    port = free_port()
    server = server_factory(models=("simple",), setup=setup_models,
                            args=["--metrics-port", str(port), "--metrics-interval-ms", "100"])
    client = server.client(arena_bytes=1 << 20)
    send_requests(client)
    with pytest.raises(errors.InvalidArgumentError):  # wrong rank: refused by the batcher
        client.infer("raiser", [np.ones((1, 4, 2), np.float32)])
    stats = {(s["name"], s["version"]): s for s in client.statistics()}
    raiser = stats[("raiser", "1")]
    assert raiser["inference_stats"]["success"]["count"] == N_OK
    assert raiser["inference_stats"]["fail"]["count"] == N_FAIL + 1
    assert raiser["shmserve"]["failures"] == {"REJECTED": 0, "CANCELED": 0, "BACKEND": N_FAIL,
                                             "OTHER": 1}

    # the CPU gauges come with the sampler's first interval
    content_type, text = wait_until(
        lambda: r if "nv_cpu_utilization " in (r := scrape(port))[1] else None, 30,
        "the CPU gauges")
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    # Triton's exact lines: counter family and samples under the same name, no _total
    assert "# TYPE nv_inference_request_success counter\n" in text, text
    assert f'nv_inference_request_success{{model="raiser",version="1"}} {N_OK}\n' in text, text
    assert (f'nv_inference_request_failure{{model="raiser",version="1",reason="BACKEND"}} '
            f'{N_FAIL}\n') in text, text
    assert not [line for line in text.splitlines()  # no counter sample named <family>_total
                if line.split("{")[0].split(" ")[0].endswith("_total")
                and not line.startswith("nv_cpu_memory_total_bytes")], text

    families = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in families, f"family {fam.name} twice"
        families[fam.name] = fam
    for name, fam in families.items():
        # no sample left over as an `unknown` singleton; every family has its samples,
        # named as the family (the parser calls counter samples <name>_total)
        assert fam.type in ("counter", "gauge"), (name, fam.type)
        assert fam.samples, f"family {name} has no samples"
        own = name + "_total" if fam.type == "counter" else name
        assert {s.name for s in fam.samples} == {own}, (name, fam.samples)
        if name.startswith("nv_inference"):
            for s in fam.samples:
                assert (s.labels["model"], s.labels["version"]) in stats, (name, s)

    # every model's counters and durations are its statistics, in Triton's units
    latency = {"nv_inference_request_duration_us": ("success", "fail"),
               "nv_inference_queue_duration_us": ("queue",),
               "nv_inference_compute_input_duration_us": ("compute_input",),
               "nv_inference_compute_infer_duration_us": ("compute_infer",),
               "nv_inference_compute_output_duration_us": ("compute_output",)}
    for key, st in stats.items():
        assert by_key(families["nv_inference_request_success"])[key] == \
            st["inference_stats"]["success"]["count"]
        assert by_key(families["nv_inference_count"])[key] == st["inference_count"]
        assert by_key(families["nv_inference_exec_count"])[key] == st["execution_count"]
        assert by_key(families["nv_inference_pending_request_count"])[key] == 0
        for name, kinds in latency.items():
            want = sum(st["inference_stats"][k]["ns"] for k in kinds) // 1000
            assert by_key(families[name])[key] == want, (name, key)
    failures = {(s.labels["model"], s.labels["reason"]): s.value
                for s in families["nv_inference_request_failure"].samples}
    assert failures[("raiser", "BACKEND")] == N_FAIL and failures[("raiser", "OTHER")] == 1
    assert failures[("broken", "BACKEND")] + failures[("broken", "OTHER")] >= 1
    assert by_key(families["nv_inference_compute_infer_duration_us"])[("raiser", "1")] > 0

    ready = by_key(families["shmserve_model_ready"])
    assert ready[("raiser", "1")] == 1 and ready[("simple", "1")] == 1
    assert ready[("broken", "1")] == 0
    batches = [s for s in families["shmserve_batches_by_requests"].samples
               if s.labels["model"] == "raiser"]
    assert sum(s.value for s in batches) == raiser["execution_count"]
    assert families["shmserve_connected_clients"].samples[0].value == 1
    (slots,) = families["shmserve_client_slots_in_use"].samples
    assert slots.value == 0 and slots.labels["pid"] == str(__import__("os").getpid())
    assert families["shmserve_ring_depth"].samples[0].value == 0
    assert families["shmserve_cpus_crowded"].samples[0].value in (0, 1)  # cpu_watch.py
    executions = {s.labels["model"]: s.value for s in families["shmserve_instance_executions"].samples}
    assert executions["raiser"] == raiser["execution_count"]
    wakeups = {(s.labels["role"], s.labels["how"]) for s in families["shmserve_wakeups"].samples}
    assert {("batcher", "spin"), ("batcher", "sleep"), ("worker", "spin")} <= wakeups
    assert 0.0 <= families["nv_cpu_utilization"].samples[0].value <= 1.0
    total = families["nv_cpu_memory_total_bytes"].samples[0].value
    assert 0 < families["nv_cpu_memory_used_bytes"].samples[0].value <= total
    assert not any(name.startswith("nv_gpu") for name in families)  # no GPU on this machine

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/elsewhere", timeout=10)
    assert e.value.code == 404


def test_summaries_on_request(server_factory):
    """--metrics-config summary_latencies=true: Triton's summary families, quantiles
    read from the server's histograms, _count and _sum those of the counters."""
    port = free_port()
    server = server_factory(models=("simple",), setup=setup_models, args=[
        "--metrics-port", str(port), "--metrics-interval-ms", "100",
        "--metrics-config", "summary_latencies=true",
        "--metrics-config", "summary_quantiles=0.5:0.05,0.99:0.001"])
    client = server.client(arena_bytes=1 << 20)
    send_requests(client)
    (st,) = client.statistics("raiser")
    _, text = scrape(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    parts = {"nv_inference_request_summary_us": ("success", "fail"),
             "nv_inference_queue_summary_us": ("queue",),
             "nv_inference_compute_input_summary_us": ("compute_input",),
             "nv_inference_compute_infer_summary_us": ("compute_infer",),
             "nv_inference_compute_output_summary_us": ("compute_output",)}
    for name, kinds in parts.items():
        fam = families[name]
        assert fam.type == "summary", name
        mine = [s for s in fam.samples if s.labels["model"] == "raiser"]
        q = {s.labels["quantile"]: s.value for s in mine if "quantile" in s.labels}
        assert set(q) == {"0.5", "0.99"}, (name, q)
        assert 0 < q["0.5"] <= q["0.99"], (name, q)
        count = next(s.value for s in mine if s.name == name + "_count")
        total = next(s.value for s in mine if s.name == name + "_sum")
        assert count == sum(st["inference_stats"][k]["count"] for k in kinds), name
        assert total == pytest.approx(sum(st["inference_stats"][k]["ns"] for k in kinds) / 1000)
        # the median lies between the smallest and largest possible request time
        assert q["0.5"] <= total, name


def test_bad_metrics_config_is_refused_by_name(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                        str(tmp_path), "--metrics-config", "sumary_latencies=true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "'sumary_latencies'" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                        str(tmp_path), "--metrics-config", "summary_quantiles=0.5:0.1,2:0.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "summary_quantiles" in r.stderr and "2.0" in r.stderr, r.stderr


def test_models_command_full_state_and_failures(server_factory):
    server = server_factory(models=("simple",), setup=setup_models)
    client = server.client(arena_bytes=1 << 20)
    send_requests(client)
    stats = {s["name"]: s for s in client.statistics()}

    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "models", "--name", server.name],
                       capture_output=True, text=True, timeout=60, env=server.env())
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = lines[0].split()[:8]
    assert head == ["model", "version", "state", "backend", "max_batch", "success", "failure",
                    "executions"], lines[0]
    rows = {}
    for i, line in enumerate(lines[1:], 1):
        if not line.startswith(" "):
            rows[line.split()[0]] = (dict(zip(head, line.split())), lines[i + 1:i + 2])
    assert set(rows) == {"simple", "raiser", "broken"}, r.stdout

    broken, after = rows["broken"]
    assert broken["state"] == "UNAVAILABLE", r.stdout
    assert after and after[0].startswith("    ") and "cannot load weights" in after[0], r.stdout
    assert int(broken["failure"]) == stats["broken"]["inference_stats"]["fail"]["count"] >= 1
    raiser, _ = rows["raiser"]
    assert raiser["state"] == "READY"
    assert int(raiser["success"]) == N_OK == stats["raiser"]["inference_stats"]["success"]["count"]
    assert int(raiser["failure"]) == N_FAIL == stats["raiser"]["inference_stats"]["fail"]["count"]
    assert int(raiser["executions"]) == stats["raiser"]["execution_count"]


def test_gpu_families_from_nvml_readings():
    """Per-GPU gauges from NVML's readings (a stand-in for pynvml: no GPU here), in
    Triton's names, labelled gpu_uuid; energy counted from the server's start."""
    import types

    from shmserve.server import metrics

    energy = {"mj": 5_000_000}

    class Util:
        gpu = 37

    class Mem:
        total, used = 80 << 30, 12 << 30

    nvml = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetUUID=lambda h: b"GPU-abc",
        nvmlDeviceGetMemoryInfo=lambda h: Mem, nvmlDeviceGetUtilizationRates=lambda h: Util,
        nvmlDeviceGetPowerUsage=lambda h: 250_000, nvmlDeviceGetPowerManagementLimit=lambda h: 700_000,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: energy["mj"])
    start: dict = {}
    metrics._gpu_readings(nvml, start)
    energy["mj"] += 3_000
    sampler = types.SimpleNamespace(cpu={}, gpus=metrics._gpu_readings(nvml, start),
                                    config={"summary_latencies": False})
    collector = metrics.StatsCollector(lambda histograms: None, sampler)
    got = {m.name: m for m in collector.machine()}
    assert set(got) == set(metrics._GPU_FAMILIES)
    value = {name: m.samples[0].value for name, m in got.items()}
    assert all(m.samples[0].labels == {"gpu_uuid": "GPU-abc"} for m in got.values())
    assert value["nv_gpu_utilization"] == 0.37
    assert value["nv_gpu_memory_used_bytes"] == 12 << 30
    assert value["nv_gpu_power_usage"] == 250.0 and value["nv_gpu_power_limit"] == 700.0
    assert value["nv_energy_consumption"] == 3.0  # joules since the first reading
    assert got["nv_energy_consumption"].type == "counter"
    text = metrics.exposition(types.SimpleNamespace(collect=lambda: got.values())).decode()
    assert 'nv_gpu_utilization{gpu_uuid="GPU-abc"} 0.37\n' in text
