"""Issue 13, traces: Triton's --trace-config (level, rate, count, mode, triton,file,
triton,log-frequency, opentelemetry,...) written from the stamps the server already
takes. The settings' parsing and the worker's sampling are checked in-process; the
trace file, its splitting and the spans against real servers (server_factory)."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import CRASHER_CODE, IDENTITY_CODE, python_config, wait_until, write_model

from shmserve import cli, errors
from shmserve.errors import ConfigError
from shmserve.protocol import Timestamp
from shmserve.server.tracing import (Sampler, TraceSink, TritonTraceFile, named_timestamps,
                                     parse_trace_config)

pytestmark = pytest.mark.timeout(120)

# Triton's timestamps, in the order they happen
TRITON = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
          "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]
X = np.ones((1, 4), np.float32)


def traces_of(path: Path) -> dict[int, dict]:
    """A Triton trace file read as trace_summary.py reads it: the objects of one id
    merged (head: model_name, model_version; timestamps in file order)."""
    merged: dict[int, dict] = {}
    for obj in json.loads(path.read_text()):
        t = merged.setdefault(obj["id"], {"timestamps": []})
        t["timestamps"] += obj.get("timestamps", [])
        t.update({k: v for k, v in obj.items() if k not in ("id", "timestamps")})
    return merged


def stamps(trace: dict) -> dict[str, int]:
    return {ts["name"]: ts["ns"] for ts in trace["timestamps"]}


def trace_args(path: Path, *more: str) -> list[str]:
    args = ["--trace-config", "level=TIMESTAMPS", "--trace-config", f"triton,file={path}"]
    for item in more:
        args += ["--trace-config", item]
    return args


# -- settings ---------------------------------------------------------------------------

def test_triton_defaults():
    cfg = parse_trace_config([])
    assert (cfg.level, cfg.rate, cfg.count, cfg.mode, cfg.file, cfg.log_frequency) == \
        ("OFF", 1000, -1, "triton", None, 0)
    assert not cfg.enabled
    assert cfg.otel_url == "http://localhost:4318/v1/traces"


def test_settings_read_as_triton_reads_them(tmp_path):
    cfg = parse_trace_config(["level=timestamps", "rate=5", "count=7", "mode=Triton",
                              f"triton,file={tmp_path}/t.json", "triton,log-frequency=3",
                              "opentelemetry,url=http://collector:4318/v1/traces"])
    assert (cfg.level, cfg.rate, cfg.count, cfg.mode, cfg.file, cfg.log_frequency) == \
        ("TIMESTAMPS", 5, 7, "triton", str(tmp_path / "t.json"), 3)
    assert cfg.notes == ["--trace-config opentelemetry,url=http://collector:4318/v1/traces: "
                         "unused in trace mode triton"]
    # an explicit OFF wins, as in Triton; what was given is named as unused
    off = parse_trace_config(["level=TIMESTAMPS", "level=OFF", f"triton,file={tmp_path}/t"])
    assert off.level == "OFF" and "triton,file" in off.notes[0]


@pytest.mark.parametrize("items, named", [
    (["bogus=1"], "'bogus'"),
    (["triton,bogus=1"], "'bogus'"),
    (["zipkin,url=x"], "'zipkin'"),
    (["mode=jaeger"], "mode=jaeger"),
    (["level=TENSORS"], "TENSORS is not implemented"),
    (["level=loud"], "level=loud"),
    (["rate=0"], "rate=0"),
    (["rate=often"], "rate=often"),
    (["count=-2"], "count=-2"),
    (["triton,log-frequency=-1"], "log-frequency=-1"),
    (["file=/tmp/t.json"], "triton,file"),  # a triton setting given as a global one
    (["level"], "'level'"),
    (["level=TIMESTAMPS"], "triton,file=PATH"),  # triton mode needs a file
    (["triton,file=/no/such/dir/t.json"], "/no/such/dir"),
    (["opentelemetry,bsp_max_queue_size=5", "opentelemetry,bsp_max_export_batch_size=10"],
     "bsp_max_export_batch_size"),
    (["opentelemetry,resource=service.name"], "resource=<key>=<value>"),
])
def test_bad_settings_are_refused_by_name(items, named):
    with pytest.raises(ConfigError) as e:
        parse_trace_config(items)
    assert named in e.value.msg


def test_serve_refuses_bad_trace_config_before_starting(tmp_path):
    for item, named in (("rate=0", "rate=0"), ("level=TENSORS", "TENSORS")):
        r = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                            str(tmp_path), "--name", "never-started", "--trace-config", item],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and named in r.stderr, r.stderr


# -- the worker's sampling, in-process -----------------------------------------------------

class FakeOps:
    def __init__(self, stamps: dict[int, int]):
        self.stamps = stamps

    def load64(self, offset: int) -> int:
        return self.stamps.get(offset, 0)


class FakeRequest:
    """What Sampler reads of a worker's Request: its slot's stamps and taken_ns."""

    def __init__(self, n: int):
        from shmserve.protocol import LAYOUT as L

        base = L["slot.t_ns"]
        self.slot_off, self.taken_ns = 0, 1000 * n + 300
        self.arena = type("A", (), {"ops": FakeOps({
            base + 8 * Timestamp.CLIENT_WRITE: 1000 * n + 100,
            base + 8 * Timestamp.ENQUEUE: 1000 * n + 200,
            base + 8 * Timestamp.BATCHED: 1000 * n + 400})})()


def run_sampler(rate: int, count: int, batches: list[int]) -> list[list[int]]:
    """Requests numbered from 1, in batches of the given sizes, through a Sampler; the
    records it sent, read back from its pipe."""
    r, w = os.pipe()
    try:
        sampler, n = Sampler({"fd": w, "rate": rate, "count": count, "level": "TIMESTAMPS"},
                             model_id=0), 0
        for size in batches:
            live = [FakeRequest(n + i + 1) for i in range(size)]
            n += size
            picked = sampler.sample(live)
            if picked:
                sampler.send(picked, 10**9, 10**9 + 1, 10**9 + 2, 10**9 + 3)
        os.close(w)
        w = None
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("batches", [[1] * 20, [3, 1, 7, 2, 5, 2], [20]])
def test_sampler_traces_every_rate_th_request_whatever_the_batches(batches):
    records = run_sampler(3, -1, batches)
    # request k's CLIENT_ENQUEUE stamp is 1000 k + 200: Triton's rule picks k = 3, 6, 9, ...
    assert [(rec[2] - 200) // 1000 for rec in records] == [3, 6, 9, 12, 15, 18]
    assert all(rec[0] == 0 and rec[3] == rec[2] + 100 for rec in records)


def test_sampler_stops_at_count():
    assert len(run_sampler(1, 2, [1, 3, 5])) == 2
    assert run_sampler(1, 0, [4]) == []


def test_caller_stamps_are_kept_only_where_they_can_be_true():
    names = [n for n, _ in named_timestamps(5, 7, 10, 12, 20, 21, 22, 23, 30)]
    assert names[:2] == ["CLIENT_WRITE", "CLIENT_ENQUEUE"] and "BATCHED" in names
    # a caller that left no stamps, or wrote impossible ones: only the server's remain
    for cw, enq, batched in ((0, 0, 0), (9, 99, 99), (11, 7, 25)):
        names = [n for n, _ in named_timestamps(cw, enq, 10, batched, 20, 21, 22, 23, 30)]
        assert names[:2] != ["CLIENT_WRITE", "CLIENT_ENQUEUE"] and "BATCHED" not in names
        assert [n for n in names if n in TRITON] == TRITON


def test_log_frequency_files_are_named_as_triton_names_them(tmp_path):
    out = TritonTraceFile(str(tmp_path / "t.json"), 2)
    for i in range(1, 6):
        out.add(i, "m", 1, [("REQUEST_START", i)])
    out.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json.0", "t.json.1", "t.json.2"]
    assert [sorted(traces_of(tmp_path / f"t.json.{n}")) for n in range(3)] == [[1, 2], [3, 4], [5]]


def test_spans_as_triton_makes_them():
    """Sampler -> pipe -> TraceSink -> spans, with the SDK's in-memory exporter."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    cfg = parse_trace_config(["level=TIMESTAMPS", "mode=opentelemetry", "rate=1"])
    exporter = InMemorySpanExporter()
    sink = TraceSink(cfg, [("simple", 3)], exporter)
    sampler = Sampler(sink.worker_boot(), model_id=0)
    sampler.send(sampler.sample([FakeRequest(1), FakeRequest(2)]), 5000, 6000, 7000, 8000)
    sink.on_readable()
    offset = sink.out.offset_ns
    sink.close()
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["InferRequest"] * 2 + ["compute"] * 2 + ["simple"] * 2
    by_id = {s.context.span_id: s for s in spans}
    for compute in (s for s in spans if s.name == "compute"):
        model = by_id[compute.parent.span_id]
        root = by_id[model.parent.span_id]
        assert (model.name, root.name, root.parent) == ("simple", "InferRequest", None)
        assert model.attributes["triton.model_name"] == "simple"
        assert model.attributes["triton.model_version"] == 3
        assert (compute.start_time, compute.end_time) == (5000 + offset, 8000 + offset)
        assert [e.name for e in compute.events] == TRITON[2:6]
        assert [e.name for e in model.events] == ["REQUEST_START", "QUEUE_START", "BATCHED",
                                                  "REQUEST_END"]
        assert [e.name for e in root.events] == ["CLIENT_WRITE", "CLIENT_ENQUEUE"]
        assert root.start_time == root.events[0].timestamp and root.end_time == model.end_time


# -- a real server ------------------------------------------------------------------------

def test_trace_file_has_one_trace_per_request_in_triton_shape(server_factory, tmp_path,
                                                               capsys):
    path = tmp_path / "trace.json"
    server = server_factory(models=("identity",), args=trace_args(path, "rate=1"))
    client = server.client(arena_bytes=1 << 20)
    results = [client.infer("identity", [X * i]) for i in range(10)]
    server.stop()
    traces = traces_of(path)
    assert sorted(traces) == list(range(1, 11))
    for t in traces.values():
        assert (t["model_name"], t["model_version"]) == ("identity", 1)
        names = [ts["name"] for ts in t["timestamps"]]
        assert names == ["CLIENT_WRITE", "CLIENT_ENQUEUE", *TRITON[:2], "BATCHED", *TRITON[2:]]
        ns = [ts["ns"] for ts in t["timestamps"]]
        assert ns == sorted(ns), names
    # the stamps are those of the requests' own slots, as their callers saw them
    for trace_name, slot_name in (("CLIENT_ENQUEUE", "ENQUEUE"), ("REQUEST_START", "DEQUEUE"),
                                  ("BATCHED", "BATCHED")):
        assert sorted(stamps(t)[trace_name] for t in traces.values()) == \
            sorted(r.timestamps_ns[Timestamp[slot_name]] for r in results)
    # and `shmserve trace-summary` reads the file as Triton's trace_summary.py would
    assert cli.main(["trace-summary", str(path)]) == 0
    summary = capsys.readouterr().out
    assert "Summary for identity (1): trace count = 10" in summary
    assert all(f"{label} (avg):" in summary for label in ("Handler", "Queue", "Compute", "Input",
                                                           "Infer", "Output", "Ring"))


def test_rate_and_count(server_factory, tmp_path):
    rated, counted = tmp_path / "rate.json", tmp_path / "count.json"
    server = server_factory(models=("identity",), args=trace_args(rated, "rate=3"))
    client = server.client(arena_bytes=1 << 20)
    for _ in range(12):
        client.infer("identity", [X])
    server.stop()
    assert len(traces_of(rated)) == 4  # one instance: Triton's exact one in three

    server = server_factory(models=("identity",), args=trace_args(counted, "rate=1", "count=2"))
    client = server.client(arena_bytes=1 << 20)
    for _ in range(6):
        client.infer("identity", [X])
    server.stop()
    assert sorted(traces_of(counted)) == [1, 2]


def test_log_frequency_splits_the_file(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    server = server_factory(models=("identity",),
                            args=trace_args(path, "rate=1", "triton,log-frequency=2"))
    client = server.client(arena_bytes=1 << 20)
    for _ in range(5):
        client.infer("identity", [X])
    server.stop()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("trace")) == \
        ["trace.json.0", "trace.json.1", "trace.json.2"]
    sizes = [len(traces_of(tmp_path / f"trace.json.{n}")) for n in range(3)]
    assert sizes == [2, 2, 1]


def test_level_off_writes_nothing(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    server = server_factory(models=("identity",),
                            args=["--trace-config", f"triton,file={path}", "--trace-config",
                                  "rate=1"])
    client = server.client(arena_bytes=1 << 20)
    for _ in range(3):
        client.infer("identity", [X])
    server.stop()
    assert not list(tmp_path.glob("trace.json*"))
    assert "unused, tracing is off" in server.log()


def setup_batching(repo) -> None:
    write_model(repo, "four", python_config(
        "four", "FP32", (-1,), dynamic_batching="{ preferred_batch_size: [ 4 ] "
        "max_queue_delay_microseconds: 3000000 }"), IDENTITY_CODE)


def test_a_batch_gives_each_request_its_trace_with_shared_compute_stamps(server_factory,
                                                                         tmp_path):
    path = tmp_path / "trace.json"
    server = server_factory(models=(), setup=setup_batching, args=trace_args(path, "rate=1"))
    client = server.client(arena_bytes=1 << 20)
    futures = [client.submit("four", [X * i]) for i in range(4)]
    for f in futures:
        f.result(timeout=30)
    assert client.statistics("four")[0]["execution_count"] == 1  # one batch of four
    server.stop()
    traces = list(traces_of(path).values())
    assert len(traces) == 4
    shared = {tuple(stamps(t)[n] for n in TRITON[2:6]) for t in traces}
    assert len(shared) == 1
    assert len({stamps(t)["CLIENT_ENQUEUE"] for t in traces}) == 4


def setup_two_instances(repo) -> None:
    write_model(repo, "pair", python_config(
        "pair", "FP32", (-1,), dynamic_batching=None,
        extra="instance_group [ { count: 2 kind: KIND_CPU } ]"), CRASHER_CODE)


def test_several_workers_and_a_restarted_one_write_one_file(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    server = server_factory(models=(), setup=setup_two_instances, args=trace_args(path, "rate=1"))
    client = server.client(arena_bytes=1 << 20)
    answered = 0

    def instances() -> list[dict]:
        return client.statistics("pair")[0]["shmserve"]["instances"]

    def concurrent_round() -> None:
        nonlocal answered
        for f in [client.submit("pair", [X]) for _ in range(8)]:
            f.result(timeout=30)
            answered += 1

    concurrent_round()
    concurrent_round()
    assert all(i["executions"] > 0 for i in instances())  # both workers traced
    with pytest.raises(errors.ShmServeError):  # its worker dies mid-batch: no trace
        client.infer("pair", [-X], timeout=30)
    wait_until(lambda: sum(i["restarts"] for i in instances()) == 1, 30, "the worker's restart")
    restarted = next(i["instance"] for i in instances() if i["restarts"])
    before = instances()[restarted]["executions"]
    wait_until(lambda: concurrent_round() or instances()[restarted]["executions"] > before, 60,
               "the restarted worker to execute requests")
    server.stop()
    traces = traces_of(path)  # one valid array, ids 1..n, whichever worker sent them
    assert sorted(traces) == list(range(1, answered + 1))


def spans_in_log(text: str) -> list[dict]:
    """The spans the SDK's ConsoleSpanExporter printed (indented JSON objects)."""
    spans, lines = [], None
    for line in text.splitlines():
        if line == "{":
            lines = [line]
        elif lines is not None:
            lines.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(lines)))
                lines = None
    return spans


class Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector stub: keeps the bodies POSTed to /v1/traces."""
    bodies: list = []

    def do_POST(self):
        self.bodies.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_opentelemetry_mode_exports_spans(server_factory):
    """To the OTLP/HTTP url where the exporter package is installed, else (said in the
    log) to the log by the SDK's console exporter."""
    pytest.importorskip("opentelemetry.sdk")
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        otlp = True
    except ImportError:
        otlp = False
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    Receiver.bodies = []
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        server = server_factory(models=("identity",), args=[
            "--trace-config", "level=TIMESTAMPS", "--trace-config", "mode=opentelemetry",
            "--trace-config", "rate=1", "--trace-config", "opentelemetry,bsp_schedule_delay=100",
            "--trace-config",
            f"opentelemetry,url=http://127.0.0.1:{receiver.server_address[1]}/v1/traces"])
        client = server.client(arena_bytes=1 << 20)
        for _ in range(3):
            client.infer("identity", [X])
        server.stop()
    finally:
        receiver.shutdown()
        receiver.server_close()
    log = server.log(tail=1 << 20)
    if otlp:  # pragma: no cover - depends on the environment
        body = b"".join(b for path, b in Receiver.bodies if path == "/v1/traces")
        assert b"compute" in body and b"InferRequest" in body and b"identity" in body
        return
    assert "opentelemetry-exporter-otlp-proto-http) is not installed" in log
    spans = spans_in_log(log)
    assert sorted(s["name"] for s in spans) == ["InferRequest"] * 3 + ["compute"] * 3 + \
        ["identity"] * 3
    model = [s for s in spans if s["name"] == "identity"]
    assert all(s["attributes"]["triton.model_version"] == 1 for s in model)
    assert all(s["resource"]["attributes"]["service.name"] == "triton-inference-server"
               for s in spans)
