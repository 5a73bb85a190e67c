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

TRITON_COUNTERS = {  # Triton family -> statistics field (None: derived, checked apart)
    "nv_inference_request_success": "request_success",
    "nv_inference_request_failure": "request_failure",
    "nv_inference_count": "inference_count",
    "nv_inference_exec_count": "execution_count",
    "nv_inference_queue_duration_us": None,
}
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


def test_metrics_exposition_parses_as_triton_families(server_factory):
    port = free_port()
    server = server_factory(models=("simple",), setup=setup_models,
                            args=["--metrics-port", str(port)])
    client = server.client(arena_bytes=1 << 20)
    send_requests(client)
    stats = {(s["name"], str(s["version"])): s for s in client.statistics()}
    assert stats[("raiser", "1")]["request_success"] == N_OK
    assert stats[("raiser", "1")]["request_failure"] == N_FAIL

    content_type, text = scrape(port)
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    # Triton's exact lines: counter family and samples under the same name, no _total
    assert "# TYPE nv_inference_request_success counter\n" in text, text
    assert f'nv_inference_request_success{{model="raiser",version="1"}} {N_OK}\n' in text, text
    assert f'nv_inference_request_failure{{model="raiser",version="1"}} {N_FAIL}\n' in text, text
    assert "_total" not in text, text

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
        for s in fam.samples:
            assert {"model", "version"} <= set(s.labels), (name, s)
            assert (s.labels["model"], s.labels["version"]) in stats, (name, s)

    for name, field in TRITON_COUNTERS.items():
        fam = families[name]
        assert fam.type == "counter", name
        values = {(s.labels["model"], s.labels["version"]): s.value for s in fam.samples}
        assert set(values) == set(stats), (name, values)
        for key, row in stats.items():
            want = row["queue_ns"] // 1000 if field is None else row[field]
            assert values[key] == want, (name, key, values[key], row)
    executed = {(s.labels["model"], s.labels["version"]): s.value
                for s in families["shmserve_execution_duration_us"].samples}
    assert executed == {k: row["compute_ns"] // 1000 for k, row in stats.items()}
    ready = {(s.labels["model"], s.labels["version"]): s.value
             for s in families["shmserve_model_ready"].samples}
    assert ready[("raiser", "1")] == 1 and ready[("simple", "1")] == 1
    assert ready[("broken", "1")] == 0
    batches = [s for s in families["shmserve_batches_by_requests"].samples
               if s.labels["model"] == "raiser"]
    assert sum(s.value for s in batches) == stats[("raiser", "1")]["execution_count"]
    # not measured by the server: not invented
    for missing in ("nv_inference_request_duration_us", "nv_inference_compute_infer_duration_us",
                    "nv_inference_compute_input_duration_us",
                    "nv_inference_compute_output_duration_us"):
        assert missing not in families

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/elsewhere", timeout=10)
    assert e.value.code == 404


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
    assert int(broken["failure"]) == stats["broken"]["request_failure"] >= 1
    raiser, _ = rows["raiser"]
    assert raiser["state"] == "READY"
    assert int(raiser["success"]) == N_OK == stats["raiser"]["request_success"]
    assert int(raiser["failure"]) == N_FAIL == stats["raiser"]["request_failure"]
    assert int(raiser["executions"]) == stats["raiser"]["execution_count"]
