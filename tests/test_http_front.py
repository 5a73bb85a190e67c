"""The HTTP/REST front (shmserve/front/http.py) with Triton's own client,
tritonclient.http: health, metadata, config, infer (JSON and binary tensor data,
every dtype, BYTES), errors as Triton words them, statistics; a killed front is
restarted; a stopped server leaves nothing behind (the fixtures' teardown checks)."""
from __future__ import annotations

import concurrent.futures
import gzip
import http.client
import json
import os
import re
import signal

import numpy as np
import psutil
import pytest

import helpers
from helpers import poll_until, python_config, write_model
from test_metrics import free_port

th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# Types tested end to end through an identity model each (BF16 needs ml_dtypes).
DTYPES = [d for d in helpers.DTYPES if d != "BF16" or helpers.HAVE_BF16]


def setup_models(repo) -> None:
    for dt in DTYPES:
        write_model(repo, f"id_{dt}", python_config(f"id_{dt}", dt, (-1,), max_batch_size=8),
                    helpers.IDENTITY_CODE)
    write_classification_models(repo)


# The classification extension's models: "classes" batched FP32 [4] whose output names
# a labels file, "classes_flat" INT32 [2, 3] without batching or labels.
LABELS = ["cat", "dog", "bird", "fish"]
CLASSES_IN = np.array([[0.1, 0.7, 0.05, 0.15], [0.3, 0.2, 0.4, 0.1]], dtype=np.float32)
CLASSES_TOP2 = [["0.700000:1:dog", "0.150000:3:fish"], ["0.400000:2:bird", "0.300000:0:cat"]]
FLAT_IN = np.array([[5, -1, 9], [9, 0, 2]], dtype=np.int32)
FLAT_TOP4 = ["9:2", "9:3", "5:0", "2:5"]  # equal values by index; no labels


def write_classification_models(repo) -> None:
    d = write_model(repo, "classes", (
        'name: "classes"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] '
        'label_filename: "labels.txt" } ]\n'), helpers.IDENTITY_CODE)
    (d / "labels.txt").write_text("\n".join(LABELS) + "\n")
    write_model(repo, "classes_flat", python_config("classes_flat", "INT32", (2, 3),
                                                    max_batch_size=0, dynamic_batching=None),
                helpers.IDENTITY_CODE)


def texts(arr) -> list:
    """A BYTES output as (nested) lists of str, however the client decoded it."""
    return np.vectorize(lambda x: x.decode() if isinstance(x, bytes) else x,
                        otypes=[object])(arr).tolist()


def fronts_of(server) -> list[int]:
    """Pids of the server's HTTP front processes."""
    try:
        children = psutil.Process(server.pid).children()
    except psutil.NoSuchProcess:
        return []
    pids = []
    for p in children:
        try:  # a killed front is a zombie until the coordinator reaps it
            if p.status() != psutil.STATUS_ZOMBIE and "shmserve.front.http" in p.cmdline():
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def wait_live(server, port: int):
    """A client of the server's HTTP front, once the front answers."""
    client = th.InferenceServerClient(f"127.0.0.1:{port}")
    assert poll_until(lambda: _live(client), 60), server.log()
    return client


def start_http(server_factory, threads: int = 1, models=("simple", "identity"), setup=None):
    return start_http_args(server_factory, ["--http-thread-count", threads], models, setup)


def start_http_args(server_factory, args, models=("simple", "identity"), setup=None):
    port = free_port()
    server = server_factory(models=models, setup=setup, args=["--http-port", port, *args])
    return server, wait_live(server, port), port


@pytest.fixture(scope="module")
def front(tmp_path_factory, mlp_onnx):
    """One server with an HTTP front for the tests that only send requests: simple,
    identity and an identity model per dtype."""
    def write(repo):
        helpers.copy_bundled(repo, mlp_onnx, names=("simple", "identity"))
        setup_models(repo)

    port = free_port()
    yield from helpers.front_server(tmp_path_factory, write, "http", port,
                                    ["--http-port", str(port)], wait_live)


def raw(port: int, method: str, path: str, body: bytes = b"", headers=None):
    """(status, decoded JSON body or raw bytes) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data


def simple_inputs(binary: bool):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [th.InferInput("INPUT0", [1, 16], "INT32"), th.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return a, b, inputs


def test_health_metadata_config(front):
    server, client, port = front
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nosuch")
    meta = client.get_server_metadata()
    assert meta["name"] == "shmserve"
    assert "binary_tensor_data" in meta["extensions"] and "statistics" in meta["extensions"]
    model = client.get_model_metadata("simple")
    assert model["name"] == "simple" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": f"INPUT{i}", "datatype": "INT32", "shape": [-1, 16]}
                               for i in range(2)]
    assert [t["name"] for t in model["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("simple", "1")["versions"] == ["1"]
    config = client.get_model_config("simple")
    assert config["name"] == "simple" and config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_INT32" and config["input"][0]["dims"] == [16]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_simple(front, binary):
    _, client, _ = front
    a, b, inputs = simple_inputs(binary)
    outputs = [th.InferRequestedOutput("OUTPUT0", binary_data=binary),
               th.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = client.infer("simple", inputs, outputs=outputs, request_id="r-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["model_name"] == "simple" and response["model_version"] == "1"
    assert response["id"] == "r-7"
    # No outputs named: all of them, as binary data (tritonclient asks binary_data_output).
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    # One output asked for: only it comes back.
    result = client.infer("simple", inputs, outputs=outputs[1:])
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("size", [1, 4096, 1 << 18])
def test_infer_identity(front, binary, size):
    _, client, _ = front
    x = np.random.default_rng(size).standard_normal((1, size)).astype(np.float32)
    inp = th.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer("identity", [inp],
                          outputs=[th.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def sample(dt: str, shape) -> np.ndarray:
    rng = np.random.default_rng(0)
    n = int(np.prod(shape))
    if dt == "BYTES":
        return np.array([f"s{i}-é".encode() for i in range(n)], dtype=object).reshape(shape)
    if dt == "BOOL":
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    from tritonclient.utils import triton_to_np_dtype

    dtype = triton_to_np_dtype(dt)
    if dt == "BF16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    return rng.integers(0, 100, n).astype(dtype).reshape(shape)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("dt", DTYPES)
def test_infer_every_dtype(front, dt, binary):
    _, client, _ = front
    if dt == "BF16" and not binary:
        pytest.skip("tritonclient sends BF16 as binary data only")
    x = sample(dt, (2, 5))
    inp = th.InferInput("INPUT0", [2, 5], dt)
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer(f"id_{dt}", [inp],
                          outputs=[th.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    got = result.as_numpy("OUTPUT0")
    if dt == "BYTES":  # JSON strings come back as str in an object array
        got = np.array([g.encode() if isinstance(g, str) else g for g in got.reshape(-1)],
                       dtype=object).reshape(got.shape)
    np.testing.assert_array_equal(got, x)


def test_request_compression(front):
    _, client, _ = front
    a, b, inputs = simple_inputs(True)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("simple", inputs, request_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_unknown_model_and_input(front):
    _, client, _ = front
    _, _, inputs = simple_inputs(True)
    with pytest.raises(InferenceServerException) as e:
        client.infer("nosuch", inputs)
    assert e.value.status() == "404"
    assert "Request for unknown model: 'nosuch' is not found" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("nosuch")
    assert "Request for unknown model: 'nosuch' is not found" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", inputs, model_version="9")
    assert "'simple' version 9 is not found" in e.value.message()
    bad = th.InferInput("NOPE", [1, 16], "INT32")
    bad.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", [bad])
    assert e.value.status() == "400" and "NOPE" in e.value.message()


def test_bad_requests_are_400_and_the_front_goes_on(front):
    _, client, port = front
    infer = "/v2/models/identity/infer"
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    hlen = {"Inference-Header-Content-Length": str(len(header))}
    cases = [
        (b"{not json", {}, "failed to parse the request JSON buffer"),
        (b'{"inputs": []}', {}, "no 'inputs'"),
        (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32",
                                 "data": [1, 2]}]}).encode(), {}, "needs 3 elements"),
        (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP99",
                                 "data": [1]}]}).encode(), {}, "unknown datatype 'FP99'"),
        (header + b"\0" * 8, hlen, "add up to 16 bytes, the body holds 8"),  # truncated
        (header + b"\0" * 20, hlen, "add up to 16 bytes, the body holds 20"),
        (header, {}, "without an Inference-Header-Content-Length"),
        (header, {"Inference-Header-Content-Length": str(len(header) + 50)},
         "unexpected end of request"),
        (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32",
                                 "parameters": {"shared_memory_region": "r"}}]}).encode(), {},
         "shared_memory_region"),
        (json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}],
                     "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 0}}]}
                    ).encode(), {}, "'classification' must be a positive integer"),
    ]
    for body, headers, words in cases:
        status, reply = raw(port, "POST", infer, body, headers)
        assert status == 400, (body[:60], reply)
        assert words in reply["error"], (words, reply)
    status, reply = raw(port, "POST", infer, b"abc", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip" in reply["error"]
    # Endpoints of extensions not served yet say so, by name.
    status, reply = raw(port, "POST", "/v2/models/simple/generate", b"{}")
    assert status == 501 and "generate extension" in reply["error"], reply
    # The repository extension: load and unload refused outside explicit mode, as Triton.
    status, reply = raw(port, "POST", "/v2/repository/models/simple/load")
    assert status == 503 and "load / unload is not allowed" in reply["error"], reply
    assert raw(port, "GET", "/v3/whatever")[0] == 404
    assert raw(port, "GET", "/v2/models/simple/infer")[0] == 405
    # A request's JSON, gzipped by hand, still works after all that.
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32",
                                   "data": [[1.5, 2.5]]}]}).encode()
    status, reply = raw(port, "POST", infer, gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200 and reply["outputs"][0]["data"] == [1.5, 2.5]
    assert client.is_server_ready()


@pytest.mark.parametrize("binary", [True, False])
def test_classification(front, binary):
    """Triton's classification extension: top-k "value:index[:label]" BYTES, per batch
    item for a batched model, over the whole tensor without batching."""
    _, client, _ = front
    inp = th.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(CLASSES_IN, binary_data=binary)
    out = client.infer("classes", [inp], outputs=[
        th.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=2)])
    assert out.get_output("OUTPUT0")["datatype"] == "BYTES"
    assert out.get_output("OUTPUT0")["shape"] == [2, 2]
    assert texts(out.as_numpy("OUTPUT0")) == CLASSES_TOP2
    inp = th.InferInput("INPUT0", [2, 3], "INT32")
    inp.set_data_from_numpy(FLAT_IN, binary_data=binary)
    for k, expected in ((4, FLAT_TOP4), (10, FLAT_TOP4 + ["0:4", "-1:1"])):
        out = client.infer("classes_flat", [inp], outputs=[
            th.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=k)])
        assert out.get_output("OUTPUT0")["shape"] == [len(expected)]
        assert texts(out.as_numpy("OUTPUT0")) == expected
    # Without class_count the output is the tensor itself.
    out = client.infer("classes_flat", [inp], outputs=[th.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), FLAT_IN)
    # A non-numeric output has no classes: 400, naming the output and its type.
    inp = th.InferInput("INPUT0", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        client.infer("id_BYTES", [inp], outputs=[th.InferRequestedOutput("OUTPUT0",
                                                                        class_count=1)])
    assert "output 'OUTPUT0'" in e.value.message() and "unsupported type 'BYTES'" in \
        e.value.message()
    assert e.value.status() == "400"


def test_classification_labels_follow_a_reload(server_factory):
    """The front keeps a model version's labels by its handle: a reload (new labels
    file) gives a new handle, so the next request has the new labels."""
    def setup(repo):
        write_classification_models(repo)

    server, client, port = start_http_args(
        server_factory, ["--model-control-mode", "explicit", "--load-model", "classes"],
        setup=setup, models=())
    inp = th.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(CLASSES_IN)
    out = [th.InferRequestedOutput("OUTPUT0", class_count=1)]
    assert texts(client.infer("classes", [inp], outputs=out).as_numpy("OUTPUT0")) == \
        [["0.700000:1:dog"], ["0.400000:2:bird"]]
    (server.repo / "classes" / "labels.txt").write_text("a\nb\nc\nd\n")
    client.load_model("classes")
    assert texts(client.infer("classes", [inp], outputs=out).as_numpy("OUTPUT0")) == \
        [["0.700000:1:b"], ["0.400000:2:c"]]


# Logs one verbose line per request, naming the request's INPUT0[0]: verbose lines of a
# worker appear only once log_verbose_level is on.
VERBOSE_CODE = '''
import logging

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        logging.getLogger("shmserve.model.test").debug("verbose-marker-%d", int(x.reshape(-1)[0]))
        return {"OUTPUT0": x}
'''


def test_trace_and_log_settings_change_while_serving(server_factory, tmp_path):
    """The trace and logging extensions: tritonclient.http reads and changes them; the
    changes reach the workers (trace records appear once tracing is on, a worker's
    verbose lines once log_verbose_level is on, its lines in ISO8601 once asked)."""
    trace_file = tmp_path / "trace.json"

    def setup(repo):
        write_model(repo, "verbose", python_config("verbose", "INT32", (1,)), VERBOSE_CODE)

    server, client, port = start_http_args(
        server_factory, ["--trace-config", f"triton,file={trace_file}"], setup=setup,
        models=("simple",))
    trace = client.get_trace_settings()
    assert trace["trace_level"] == ["OFF"] and trace["trace_rate"] == "1000"
    assert trace["trace_file"] == str(trace_file) and trace["trace_mode"] == "triton"
    assert client.get_trace_settings(model_name="simple") == trace

    def infer(model: str, n: int):
        inp = th.InferInput("INPUT0", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[n]], dtype=np.int32))
        return client.infer(model, [inp])

    infer("verbose", 1)  # answered: its verbose line was not shown
    changed = client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"],
                                                     "trace_rate": "1"})
    assert changed["trace_level"] == ["TIMESTAMPS"] and changed["trace_rate"] == "1"
    assert client.get_trace_settings() == changed
    # The workers apply it within their watcher's interval: requests until one is traced.
    assert poll_until(lambda: infer("verbose", 0) and trace_file.exists() and
                      '"model_name":"verbose"' in trace_file.read_text(), 30), server.log()
    # Back to the values at start (null), then tracing is off again.
    assert client.update_trace_settings(settings={"trace_level": None,
                                                  "trace_rate": None}) == trace
    # Logging: verbose lines of the workers once asked for.
    logs = client.get_log_settings()
    assert logs == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                    "log_verbose_level": 0, "log_format": "default"}
    assert client.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
    full_log = lambda: server.log_path.read_text(errors="replace")  # noqa: E731
    assert poll_until(lambda: infer("verbose", 2) and "verbose-marker-2" in full_log(), 30)
    assert "verbose-marker-1" not in full_log()
    client.update_log_settings({"log_format": "ISO8601"})
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ worker/.*verbose-marker-3$", re.M)
    assert poll_until(lambda: infer("verbose", 3) and iso.search(full_log()), 30), full_log()[-2000:]
    assert client.update_log_settings({"log_verbose_level": 0, "log_format": "default"}) == logs
    # Errors name the setting: 400 with Triton's {"error": ...}.
    cases = [
        ("/v2/trace/setting", {"trace_rate": "0"}, "'trace_rate' must be an integer of at least 1"),
        ("/v2/trace/setting", {"trace_level": ["TENSORS"]}, "TENSORS is not implemented"),
        ("/v2/trace/setting", {"trace_file": "/tmp/elsewhere.json"},
         "trace file location can not be updated"),
        ("/v2/trace/setting", {"trace_colour": "1"}, "trace setting 'trace_colour' is unknown"),
        ("/v2/models/simple/trace/setting", {"trace_rate": "5"}, "per-model trace settings"),
        ("/v2/logging", {"log_info": "yes"}, "log setting 'log_info' takes a bool"),
        ("/v2/logging", {"log_verbose_level": -1}, "'log_verbose_level' must be a non-negative"),
        ("/v2/logging", {"log_format": "XML"}, "'log_format': 'XML' is not one of"),
        ("/v2/logging", {"log_file": "relative.log"}, "is not an absolute path"),
        ("/v2/logging", {"log_colour": True}, "log setting 'log_colour' is unknown"),
    ]
    for path, body, words in cases:
        status, reply = raw(port, "POST", path, json.dumps(body).encode())
        assert status == 400 and words in reply["error"], (body, reply)
    assert raw(port, "GET", "/v2/models/nosuch/trace/setting")[0] == 404
    assert raw(port, "POST", "/v2/logging", b"[1]")[0] == 400
    assert client.get_log_settings() == logs and client.get_trace_settings() == trace


def test_statistics(front):
    _, client, _ = front
    _, _, inputs = simple_inputs(True)
    before = client.get_inference_statistics("simple")["model_stats"][0]
    for _ in range(3):
        client.infer("simple", inputs)
    stats = client.get_inference_statistics("simple")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("simple", "1")]
    assert "shmserve" not in stats[0]  # shmserve's own figures stay off the v2 API
    assert (stats[0]["inference_stats"]["success"]["count"]
            == before["inference_stats"]["success"]["count"] + 3)
    every = client.get_inference_statistics()["model_stats"]
    assert {"simple", "identity"} <= {s["name"] for s in every}
    with pytest.raises(InferenceServerException) as e:
        client.get_inference_statistics("nosuch")
    assert "Request for unknown model: 'nosuch' is not found" in e.value.message()


def test_killed_front_is_restarted(server_factory):
    server, client, port = start_http(server_factory, threads=2, models=("simple",))
    try:
        # every front started (one answering the port is not enough): a front that dies
        # while the server starts fails the start, by design
        assert poll_until(lambda: "HTTP service on http://" in server.log(), 30), server.log()
        fronts = fronts_of(server)
        assert len(fronts) == 2
        os.kill(fronts[0], signal.SIGKILL)
        # the supervisor logs the restart once the new front is spawned; its pids are
        # read once per poll (two reads could see the killed one alive, then gone)
        assert poll_until(lambda: "front restarted: HTTP front" in server.log(), 30), \
            server.log()
        assert poll_until(lambda: (lambda now: len(now) == 2 and fronts[0] not in now)(
            fronts_of(server)), 30), server.log()
        assert poll_until(lambda: all(listening(p, port) for p in fronts_of(server)), 30), \
            server.log()
        a, b, inputs = simple_inputs(True)
        for _ in range(8):  # connections spread over both fronts, the new one included
            fresh = th.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                assert poll_until(lambda: _live(fresh), 30)
                np.testing.assert_array_equal(fresh.infer("simple", inputs).as_numpy("OUTPUT0"),
                                              a + b)
            finally:
                fresh.close()
    finally:
        client.close()
    assert server.stop() == 0
    assert not fronts_of(server)
    stops = [line for line in server.log_path.read_text().splitlines()
             if "front exited: HTTP front" in line]
    assert len(stops) == 3 and stops[1:] == [s for s in stops[1:] if s.endswith("exit code 0")], \
        stops  # the SIGKILLed one, then both stopped cleanly


def listening(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections("tcp"))
    except psutil.Error:
        return False


def _live(client) -> bool:
    try:
        return client.is_server_live()
    except Exception:
        return False


def test_port_taken_stops_the_start(server_factory):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = server_factory(models=("simple",), args=["--http-port", port], start=False)
        with pytest.raises(RuntimeError):
            server.start()
        assert server.proc.wait(30) == 2
        assert f"--http-port {port}" in server.log()


def test_engine_killed_answers_the_waiting_caller(server_factory):
    """The coordinator SIGKILLed while an HTTP request waits on a model: its fronts die
    with it (PDEATHSIG), so the caller gets an error at once, not a hang."""
    def with_sleeper(repo):
        write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,),
                                                   dynamic_batching=None), helpers.SLEEPER_CODE)

    server, client, port = start_http(server_factory, models=(), setup=with_sleeper)
    fronts = fronts_of(server)
    try:
        inp = th.InferInput("INPUT0", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[30.0]], np.float32))
        own = server.client(arena_bytes=1 << 16)  # sees the request in flight
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: th.InferenceServerClient(f"127.0.0.1:{port}")
                                  .infer("sleeper", [inp]))
            in_flight = lambda: any(row["pid"] in fronts and row["slots_in_use"]  # noqa: E731
                                    for row in own.server_status()["clients"])
            assert poll_until(lambda: waiting.done() or in_flight(), 20), server.log()
            assert not waiting.done(), waiting.exception()
            server.kill()
            server.proc.wait(10)
            with pytest.raises(Exception):
                waiting.result(timeout=20)  # an error, not a hang
        assert poll_until(lambda: not any(psutil.pid_exists(p) and
                                          psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                          for p in fronts), 10)
        with pytest.raises(Exception):
            client.is_server_live()
    finally:
        client.close()
