"""The gRPC front (shmserve/front/grpc.py) with Triton's own clients, tritonclient.grpc
and tritonclient.grpc.aio, and with the raw GRPCInferenceService stub for what
tritonclient never sends (typed contents, lying shapes, truncated raw contents):
every RPC, every dtype, streaming, errors with Triton's status codes and words,
compression, hostile input; a killed front is restarted; a killed engine gives
UNAVAILABLE, not a hang; perf_analyzer where its binary runs."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest

import helpers
from helpers import poll_until, python_config, write_model
from shmserve_bench.harness import unique_name
from test_http_front import CLASSES_IN, CLASSES_TOP2, FLAT_IN, FLAT_TOP4, listening, sample, \
    setup_models, texts
from test_metrics import free_port

grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
import tritonclient.grpc.aio as tga  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(180)

DTYPES = [d for d in helpers.DTYPES if d != "BF16" or helpers.HAVE_BF16]
ARENA = 16 << 20  # the fixture server's --max-arena-bytes: its fronts take messages this big
Code = grpc.StatusCode


def grpc_fronts(server) -> list[int]:
    """Pids of the server's gRPC front processes (zombies left out)."""
    try:
        children = psutil.Process(server.pid).children()
    except psutil.NoSuchProcess:
        return []
    pids = []
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "shmserve.front.grpc" in p.cmdline():
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def _live(client) -> bool:
    try:
        return client.is_server_live()
    except Exception:
        return False


def wait_live(server, port: int):
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    assert poll_until(lambda: _live(client), 60), server.log()
    return client


@pytest.fixture(scope="module")
def front(tmp_path_factory, mlp_onnx):
    """One server with a gRPC front (and response compression) for the tests that only
    send requests: simple, identity and an identity model per dtype."""
    def write(repo):
        helpers.copy_bundled(repo, mlp_onnx, names=("simple", "identity"))
        setup_models(repo)

    port = free_port()
    yield from helpers.front_server(
        tmp_path_factory, write, "grpc", port,
        ["--grpc-port", str(port), "--max-arena-bytes", str(ARENA),
         "--grpc-infer-response-compression-level", "high",
         "--grpc-keepalive-time", "60000", "--grpc-keepalive-permit-without-calls", "true",
         "--grpc-http2-max-pings-without-data", "0"], wait_live)


@pytest.fixture
def stub(front):
    """The raw GRPCInferenceService stub, for requests tritonclient would never send."""
    channel = grpc.insecure_channel(f"127.0.0.1:{front[2]}",
                                    options=[("grpc.max_send_message_length", -1)])
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def simple_inputs():
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [tg.InferInput("INPUT0", [1, 16], "INT32"), tg.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return a, b, inputs


def rpc_error(fn, *args, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kw)
    return e.value


def test_health_metadata_config(front):
    _, client, _ = front
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nosuch")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "shmserve"
    assert {"binary_tensor_data", "statistics", "model_configuration"} <= set(meta["extensions"])
    model = client.get_model_metadata("simple", as_json=True)
    assert model["name"] == "simple" and model["versions"] == ["1"]
    assert model["platform"] == "python"
    assert model["inputs"] == [{"name": f"INPUT{i}", "datatype": "INT32", "shape": ["-1", "16"]}
                               for i in range(2)]
    assert [t["name"] for t in model["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("simple", "1").versions == ["1"]
    config = client.get_model_config("simple").config
    assert config.name == "simple" and config.max_batch_size == 8
    assert config.input[0].data_type == 8 and list(config.input[0].dims) == [16]  # TYPE_INT32
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    for call in (client.get_model_metadata, client.get_model_config):
        e = rpc_error(call, "nosuch")
        assert e.status() == "StatusCode.NOT_FOUND"
        assert e.message() == "Request for unknown model: 'nosuch' is not found"
    e = rpc_error(client.get_model_metadata, "simple", "x")
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "version 'x'" in e.message()


def test_infer_simple(front):
    _, client, _ = front
    a, b, inputs = simple_inputs()
    outputs = [tg.InferRequestedOutput("OUTPUT0"), tg.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs, request_id="r-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "r-7")
    assert [o.datatype for o in response.outputs] == ["INT32", "INT32"]
    # No outputs named: all of them; one named: only it.
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT1"), a - b)
    result = client.infer("simple", inputs, outputs=outputs[1:], model_version="1")
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@pytest.mark.parametrize("size", [1, 4096, 1 << 18])
def test_infer_identity(front, size):
    _, client, _ = front
    x = np.random.default_rng(size).standard_normal((1, size)).astype(np.float32)
    inp = tg.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("identity", [inp]).as_numpy("OUTPUT0"), x)


@pytest.mark.parametrize("dt", DTYPES)
def test_infer_every_dtype(front, dt):
    _, client, _ = front
    x = sample(dt, (2, 5))
    inp = tg.InferInput("INPUT0", [2, 5], dt)
    inp.set_data_from_numpy(x)
    result = client.infer(f"id_{dt}", [inp])
    assert result.get_output("OUTPUT0").datatype == dt
    got = result.as_numpy("OUTPUT0")
    if dt == "BF16":  # tritonclient gives BF16 back as float32
        got = got.astype(x.dtype)
    np.testing.assert_array_equal(got, x)


TYPED = [d for d in DTYPES if d not in ("FP16", "BF16")]  # the proto has no field for those


@pytest.mark.parametrize("dt", TYPED)
def test_typed_contents(stub, dt):
    """Inputs in InferTensorContents (what other gRPC clients send): the answer is the
    same tensor, as raw output contents."""
    from shmserve.front.grpc import CONTENTS

    x = sample(dt, (2, 3))
    request = pb.ModelInferRequest(model_name=f"id_{dt}")
    t = request.inputs.add(name="INPUT0", datatype=dt, shape=[2, 3])
    getattr(t.contents, CONTENTS[dt]).extend(x.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    assert response.outputs[0].datatype == dt and list(response.outputs[0].shape) == [2, 3]
    result = tg.InferResult(response)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_async_infer_callbacks(front):
    _, client, _ = front
    done = queue.Queue()
    sent = {}
    for i in range(8):
        x = np.full((1, 64), i, np.float32)
        inp = tg.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        sent[str(i)] = x
        client.async_infer("identity", [inp], lambda result, error: done.put((result, error)),
                           request_id=str(i))
    for _ in range(8):
        result, error = done.get(timeout=60)
        assert error is None, error
        rid = result.get_response().id
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), sent.pop(rid))
    assert not sent


def test_stream_infer(front):
    """More requests on one stream than the front reads ahead (its lease's 32 slots),
    one of them for a model that does not exist: each is answered on the stream, the
    bad one with Triton's error message."""
    _, _, port = front
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    answers = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(40):
            inp = tg.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(np.full((1, 4), i, np.float32))
            client.async_stream_infer("nosuch" if i == 3 else "identity", [inp],
                                      request_id=f"s{i}")
        got = [answers.get(timeout=60) for _ in range(40)]
    finally:
        client.stop_stream()
        client.close()
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "Request for unknown model: 'nosuch' is not found" in str(errors[0])
    results = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in got if e is None}
    assert sorted(results) == sorted(f"s{i}" for i in range(40) if i != 3)
    for rid, out in results.items():
        np.testing.assert_array_equal(out, np.full((1, 4), int(rid[1:]), np.float32))


def test_aio_client(front):
    """tritonclient.grpc.aio: health, metadata, infer, and a stream of requests."""
    _, _, port = front
    a, b, inputs = simple_inputs()

    async def main():
        client = tga.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert await client.is_server_live() and await client.is_model_ready("simple")
            assert (await client.get_model_metadata("simple")).name == "simple"
            results = await asyncio.gather(*[client.infer("simple", inputs, request_id=str(i))
                                             for i in range(4)])
            for r in results:
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)

            async def requests():
                for i in range(5):
                    inp = tg.InferInput("INPUT0", [1, 3], "FP32")
                    inp.set_data_from_numpy(np.full((1, 3), i, np.float32))
                    yield {"model_name": "identity", "inputs": [inp], "request_id": str(i)}

            seen = {}
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                seen[result.get_response().id] = result.as_numpy("OUTPUT0")[0, 0]
                if len(seen) == 5:
                    break
            assert seen == {str(i): float(i) for i in range(5)}
        finally:
            await client.close()

    asyncio.run(main())


def test_errors_have_triton_codes(front):
    _, client, _ = front
    a, b, inputs = simple_inputs()

    def inp(name, shape, dt, arr):
        t = tg.InferInput(name, shape, dt)
        t.set_data_from_numpy(arr)
        return t

    z = np.zeros((1, 16), np.int32)
    cases = [
        (("nosuch", inputs), {}, "NOT_FOUND", "Request for unknown model: 'nosuch' is not found"),
        (("simple", inputs), {"model_version": "9"}, "NOT_FOUND",
         "Request for unknown model: 'simple' version 9 is not found"),
        (("simple", inputs[:1]), {}, "INVALID_ARGUMENT", "missing input 'INPUT1'"),
        (("simple", [inp("INPUT0", [1, 16], "FP32", z.astype(np.float32)), inputs[1]]), {},
         "INVALID_ARGUMENT", "input 'INPUT0' has data type FP32, expected INT32"),
        (("simple", [inp("INPUT0", [1, 8], "INT32", z[:, :8]), inp("INPUT1", [1, 8], "INT32", z[:, :8])]),
         {}, "INVALID_ARGUMENT", "dimension 1 is 8, expected 16"),
        (("simple", [inp("NOPE", [1, 16], "INT32", z), inputs[1]]), {}, "INVALID_ARGUMENT",
         "has no input 'NOPE'"),
        (("simple", inputs), {"outputs": [tg.InferRequestedOutput("NOPE")]}, "INVALID_ARGUMENT",
         "has no output 'NOPE'"),
        (("simple", inputs), {"sequence_id": 5}, "INVALID_ARGUMENT",
         "model 'simple' has no sequence_batching"),
        (("id_BYTES", [_bytes_input()]),
         {"outputs": [tg.InferRequestedOutput("OUTPUT0", class_count=2)]},
         "INVALID_ARGUMENT", "class result not available for output due to unsupported type"),
    ]
    for args, kw, code, words in cases:
        e = rpc_error(client.infer, *args, **kw)
        assert e.status() == f"StatusCode.{code}", (words, e)
        assert words in e.message(), (words, e.message())
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)


def _bytes_input():
    inp = tg.InferInput("INPUT0", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    return inp


def test_classification(front, stub):
    """Triton's classification extension over gRPC (test_http_front's models)."""
    _, client, _ = front
    inp = tg.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(CLASSES_IN)
    out = client.infer("classes", [inp], outputs=[tg.InferRequestedOutput("OUTPUT0",
                                                                          class_count=2)])
    assert out.get_output("OUTPUT0").datatype == "BYTES"
    assert list(out.get_output("OUTPUT0").shape) == [2, 2]
    assert texts(out.as_numpy("OUTPUT0")) == CLASSES_TOP2
    inp = tg.InferInput("INPUT0", [2, 3], "INT32")
    inp.set_data_from_numpy(FLAT_IN)
    out = client.infer("classes_flat", [inp], outputs=[tg.InferRequestedOutput("OUTPUT0",
                                                                               class_count=4)])
    assert texts(out.as_numpy("OUTPUT0")) == FLAT_TOP4
    # A bad count, as tritonclient never sends it: INVALID_ARGUMENT naming the parameter.
    request = pb.ModelInferRequest(model_name="classes_flat")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[2, 3])
    request.raw_input_contents.append(FLAT_IN.tobytes())
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = -1
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request)
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert "'classification' must be a positive integer" in e.value.details()


def test_hostile_requests(front, stub):
    """What tritonclient never sends: each is INVALID_ARGUMENT (or RESOURCE_EXHAUSTED)
    naming the fault, and the front goes on serving."""
    _, client, _ = front

    def request(shape=(1, 4), datatype="FP32", raw=(b"\0" * 16,), name="INPUT0", model="identity"):
        r = pb.ModelInferRequest(model_name=model)
        r.inputs.add(name=name, datatype=datatype, shape=list(shape))
        r.raw_input_contents.extend(raw)
        return r

    two = request()
    two.raw_input_contents.append(b"\0" * 16)
    typed = request(raw=())
    typed.inputs[0].contents.int_contents.extend([1, 2, 3, 4])
    short = request(raw=())
    short.inputs[0].contents.fp32_contents.extend([1.0])
    both = request()
    both.inputs[0].contents.fp32_contents.extend([1.0] * 4)
    wide = request(datatype="INT8", raw=(), model="id_INT8")
    wide.inputs[0].contents.int_contents.extend([1, 2, 300, 4])
    half = request(datatype="FP16", raw=(), model="id_FP16")
    half.inputs[0].contents.fp32_contents.extend([1.0] * 4)
    bad_param = request()
    bad_param.inputs[0].parameters["shared_memory_region"].string_param = "r"
    cases = [
        (request(raw=(b"\0" * 8,)), Code.INVALID_ARGUMENT,
         "raw_input_contents holds 8 bytes: shape [1, 4] of FP32 is 16 bytes"),  # truncated
        (request(shape=(1, 1 << 20)), Code.INVALID_ARGUMENT, "is 4194304 bytes"),  # lying shape
        (request(shape=(1, -4)), Code.INVALID_ARGUMENT, "non-negative integers"),
        (request(datatype="FP99"), Code.INVALID_ARGUMENT, "unknown datatype 'FP99'"),
        (request(raw=()), Code.INVALID_ARGUMENT, "has no data"),
        (two, Code.INVALID_ARGUMENT, "1 inputs outside shared memory and 2 raw_input_contents"),
        (typed, Code.INVALID_ARGUMENT, "contents.int_contents given for a FP32 tensor"),
        (short, Code.INVALID_ARGUMENT, "needs 4 elements, contents.fp32_contents has 1"),
        (both, Code.INVALID_ARGUMENT, "both contents and raw_input_contents"),
        (wide, Code.INVALID_ARGUMENT, "out of INT8's range"),
        (half, Code.INVALID_ARGUMENT, "FP16 has no typed contents field"),
        (request(datatype="BYTES", raw=(b"\x09\0\0\0abc",), shape=(1, 1), model="id_BYTES"),
         Code.INVALID_ARGUMENT, "input 'INPUT0'"),  # a BYTES length past the end
        (bad_param, Code.INVALID_ARGUMENT, "'shared_memory_byte_size' must be specified along "
         "with 'shared_memory_region'"),
        (pb.ModelInferRequest(model_name="identity"), Code.INVALID_ARGUMENT, "no inputs"),
        (request(raw=(b"\0" * (ARENA + 64),), shape=(1, (ARENA + 64) // 4)),
         Code.RESOURCE_EXHAUSTED, "larger than max"),  # more than the front's arena
    ]
    for req, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=60)
        assert e.value.code() == code, (words, e.value.details())
        assert words in e.value.details(), (words, e.value.details())
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    ok = stub.ModelInfer(request(raw=(x.tobytes(),)))
    np.testing.assert_array_equal(np.frombuffer(ok.raw_output_contents[0], np.float32), x[0])
    assert client.is_server_ready()


def test_statistics(front):
    _, client, _ = front
    _, _, inputs = simple_inputs()
    before = client.get_inference_statistics("simple").model_stats[0]
    for _ in range(3):
        client.infer("simple", inputs)
    stats = client.get_inference_statistics("simple", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("simple", "1")]
    assert (int(stats[0]["inference_stats"]["success"]["count"])
            == before.inference_stats.success.count + 3)
    assert int(stats[0]["inference_count"]) >= 3
    every = client.get_inference_statistics().model_stats
    assert {"simple", "identity"} <= {s.name for s in every}
    e = rpc_error(client.get_inference_statistics, "nosuch")
    assert e.status() == "StatusCode.NOT_FOUND" and "'nosuch' is not found" in e.message()


def test_trace_and_log_settings(front, stub):
    """The trace and logging extensions over gRPC (test_http_front checks that changes
    reach the workers): read, change, back to the values at start, errors by name."""
    server, client, _ = front
    trace = client.get_trace_settings(as_json=True)["settings"]
    assert trace["trace_level"]["value"] == ["OFF"] and trace["trace_rate"]["value"] == ["1000"]
    assert client.get_trace_settings(model_name="simple", as_json=True)["settings"] == trace
    changed = client.update_trace_settings(settings={"trace_rate": "7", "trace_count": "3"},
                                           as_json=True)["settings"]
    assert changed["trace_rate"]["value"] == ["7"] and changed["trace_count"]["value"] == ["3"]
    # An empty value (tritonclient's None) sets a setting back to its value at start.
    back = client.update_trace_settings(settings={"trace_rate": None, "trace_count": None},
                                        as_json=True)["settings"]
    assert back == trace
    for settings, words in [({"trace_level": ["TIMESTAMPS"]}, "needs a trace file"),
                            ({"trace_rate": "many"}, "'trace_rate' must be an integer"),
                            ({"trace_mode": "opentelemetry"}, "trace_mode can not be updated"),
                            ({"trace_colour": "red"}, "'trace_colour' is unknown")]:
        e = rpc_error(client.update_trace_settings, settings=settings)
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and words in e.message(), e
    e = rpc_error(client.update_trace_settings, model_name="simple", settings={"trace_rate": "2"})
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "per-model" in e.message()
    e = rpc_error(client.get_trace_settings, model_name="nosuch")
    assert e.status() == "StatusCode.NOT_FOUND"
    logs = client.get_log_settings(as_json=True)["settings"]
    assert logs["log_info"] == {"bool_param": True}
    assert logs["log_format"] == {"string_param": "default"}
    assert logs["log_verbose_level"] == {"uint32_param": 0}
    changed = client.update_log_settings({"log_warning": False, "log_verbose_level": 2},
                                         as_json=True)["settings"]
    assert changed["log_warning"] == {"bool_param": False}
    assert changed["log_verbose_level"] == {"uint32_param": 2}
    assert client.update_log_settings({"log_warning": True, "log_verbose_level": 0},
                                      as_json=True)["settings"] == logs
    for settings, words in [({"log_colour": True}, "'log_colour' is unknown"),
                            ({"log_format": "XML"}, "'XML' is not one of")]:
        e = rpc_error(client.update_log_settings, settings)
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and words in e.message(), e
    request = pb.LogSettingsRequest()  # a type tritonclient would not send for the key
    request.settings["log_info"].string_param = "yes"
    with pytest.raises(grpc.RpcError) as e:
        stub.LogSettings(request)
    assert e.value.code() == Code.INVALID_ARGUMENT
    assert "'log_info' takes a bool" in e.value.details()
    assert client.get_log_settings(as_json=True)["settings"] == logs


def test_model_repository_outside_explicit_mode(front):
    """The repository extension: the index answers; load and unload are refused as
    Triton refuses them outside --model-control-mode explicit (tests/test_model_control.py
    loads and unloads)."""
    _, client, _ = front
    index = {m.name: m for m in client.get_model_repository_index(as_json=False).models}
    assert index["simple"].state == "READY" and index["simple"].version == "1"
    for call in (client.load_model, client.unload_model):
        e = rpc_error(call, "simple")
        assert e.status() == "StatusCode.UNAVAILABLE", e
        assert "explicit model load / unload is not allowed" in e.message(), e.message()


def test_system_shared_memory(front):
    """Triton's system shared memory RPCs with tritonclient.utils.shared_memory: one
    registry with the HTTP front's (front/shm.py); inputs read from a region, an output
    written into one and listed without data, a request mixing a region and raw
    contents; errors by name; CUDA regions refused (no GPU build)."""
    from test_http_shm import Regions, contents

    _, client, _ = front
    regions = Regions(client)
    try:
        a, b, raw_inputs = simple_inputs()
        h_in = regions.create("in", 128)
        h_out = regions.create("out", 64)
        shm.set_shared_memory_region(h_in, [a, b])
        status = json_format.MessageToDict(client.get_system_shared_memory_status())
        assert {r["name"]: r.get("byteSize") for r in status["regions"].values()} == {
            "in": "128", "out": "64"}
        inputs = [tg.InferInput("INPUT0", [1, 16], "INT32"), tg.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        outputs = [tg.InferRequestedOutput("OUTPUT0"), tg.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        result = client.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(contents(h_out, np.int32, [1, 16]), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)  # in the message
        out0 = result.get_output("OUTPUT0")
        assert out0.parameters["shared_memory_region"].string_param == "out"
        assert out0.parameters["shared_memory_byte_size"].int64_param == 64
        mixed = client.infer("simple", [inputs[0], raw_inputs[1]])  # region + raw contents
        np.testing.assert_array_equal(mixed.as_numpy("OUTPUT0"), a + b)
        inputs[1].set_shared_memory("in", 32, offset=64)  # half the tensor
        e = rpc_error(client.infer, "simple", inputs)
        assert e.status() == "StatusCode.INVALID_ARGUMENT"
        assert "input byte size mismatch for input 'INPUT1'" in e.message(), e.message()
        inputs[1].set_shared_memory("nowhere", 64)
        e = rpc_error(client.infer, "simple", inputs)
        assert "nowhere" in e.message(), e.message()
    finally:
        regions.close()
    assert not json_format.MessageToDict(client.get_system_shared_memory_status())
    e = rpc_error(client.register_system_shared_memory, "x", "/no_such_object_here", 64)
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "/no_such_object_here" in e.message()
    e = rpc_error(client.register_cuda_shared_memory, "r", "aGFuZGxl", 0, 64)
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "needs a GPU build" in e.message()
    assert not json_format.MessageToDict(client.get_cuda_shared_memory_status())
    client.unregister_cuda_shared_memory()


class CountingProxy:
    """A TCP relay to the front that counts the bytes the server sends back."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(conn, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, True), daemon=True).start()

    def _pump(self, src, dst, count):
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self.lock:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_compression(front):
    """Requests compressed by the client (gzip, deflate) are read; with
    --grpc-infer-response-compression-level high a 1 MiB answer of zeros travels in far
    fewer bytes than its raw contents."""
    _, client, port = front
    a, b, inputs = simple_inputs()
    for algorithm in ("gzip", "deflate"):
        result = client.infer("simple", inputs, compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    proxy = CountingProxy(port)
    relayed = tg.InferenceServerClient(f"127.0.0.1:{proxy.port}")
    try:
        x = np.zeros((1, 1 << 18), np.float32)  # 1 MiB
        inp = tg.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(relayed.infer("identity", [inp]).as_numpy("OUTPUT0"), x)
        assert 0 < proxy.down < x.nbytes // 8, proxy.down
    finally:
        relayed.close()
        proxy.close()


def start_grpc(server_factory, threads: int = 1, models=("simple",), setup=None):
    port = free_port()
    server = server_factory(models=models, setup=setup, args=[
        "--grpc-port", port, "--grpc-infer-thread-count", threads])
    return server, wait_live(server, port), port


def test_trace_turned_on_over_grpc_reaches_the_workers(server_factory, tmp_path):
    """update_trace_settings over gRPC turns tracing on while serving: the workers
    trace the requests that follow."""
    trace_file = tmp_path / "trace.json"
    port = free_port()
    server = server_factory(models=("simple",), args=[
        "--grpc-port", port, "--trace-config", f"triton,file={trace_file}"])
    client = wait_live(server, port)
    a, b, inputs = simple_inputs()
    client.infer("simple", inputs)
    assert not trace_file.exists()  # off at start: nothing traced
    settings = client.update_trace_settings(
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, as_json=True)["settings"]
    assert settings["trace_level"]["value"] == ["TIMESTAMPS"]
    assert poll_until(lambda: client.infer("simple", inputs) and trace_file.exists()
                      and '"model_name":"simple"' in trace_file.read_text(), 30), server.log()
    client.update_trace_settings(settings={"trace_level": ["OFF"]})
    client.close()


def test_killed_front_is_restarted(server_factory):
    server, client, port = start_grpc(server_factory, threads=2)
    try:
        assert poll_until(lambda: "gRPC service on grpc://" in server.log(), 30), server.log()
        fronts = grpc_fronts(server)
        assert len(fronts) == 2
        os.kill(fronts[0], signal.SIGKILL)
        # the supervisor logs the restart once the new front is spawned; its pids are
        # read once per poll (two reads could see the killed one alive, then gone)
        assert poll_until(lambda: "front restarted: gRPC front" in server.log(), 30), \
            server.log()
        assert poll_until(lambda: (lambda now: len(now) == 2 and fronts[0] not in now)(
            grpc_fronts(server)), 30), server.log()
        assert poll_until(lambda: all(listening(p, port) for p in grpc_fronts(server)), 30), \
            server.log()
        a, b, inputs = simple_inputs()
        for _ in range(8):  # connections spread over both fronts, the new one included
            fresh = tg.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                assert poll_until(lambda: _live(fresh), 30)
                np.testing.assert_array_equal(fresh.infer("simple", inputs).as_numpy("OUTPUT0"),
                                              a + b)
            finally:
                fresh.close()
    finally:
        client.close()
    assert server.stop() == 0
    assert not grpc_fronts(server)
    stops = [line for line in server.log_path.read_text().splitlines()
             if "front exited: gRPC front" in line]
    assert len(stops) == 3 and all(s.endswith("exit code 0") for s in stops[1:]), stops


def test_front_signalled_again_while_stopping_exits_cleanly(server_factory):
    """The coordinator's shutdown may signal a stopping front again: the front still
    exits 0 (it is then restarted here, as the coordinator does any exited front)."""
    import time

    server, client, _ = start_grpc(server_factory)
    client.close()
    front = grpc_fronts(server)[0]
    for pause in (0, 0.001, 0.05, 0.3):
        try:
            os.kill(front, signal.SIGTERM)
        except ProcessLookupError:  # it has exited already
            break
        time.sleep(pause)
    assert poll_until(lambda: "front exited: gRPC front 0" in server.log(), 30), server.log()
    line = next(x for x in server.log().splitlines() if "front exited: gRPC front 0" in x)
    assert "exit code 0" in line, line


def test_http_and_grpc_fronts_together(server_factory):
    """Both fronts on one engine, each on its port, answering the same model."""
    import tritonclient.http as th

    http_port, grpc_port = free_port(), free_port()
    server = server_factory(models=("simple",), args=["--http-port", http_port,
                                                      "--grpc-port", grpc_port])
    client = wait_live(server, grpc_port)
    web = th.InferenceServerClient(f"127.0.0.1:{http_port}")
    try:
        a, b, inputs = simple_inputs()
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
        assert web.is_model_ready("simple")
        log = server.log()
        assert "HTTP service on http://" in log and "gRPC service on grpc://" in log
    finally:
        client.close()
        web.close()


def test_port_taken_stops_the_start(server_factory):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        server = server_factory(models=("simple",), args=["--grpc-port", port], start=False)
        with pytest.raises(RuntimeError):
            server.start()
        assert server.proc.wait(30) == 2
        assert f"--grpc-port {port}" in server.log()


@pytest.mark.parametrize("args, words", [
    (["--grpc-port", "0"], "--grpc-port 0 is not a port number"),
    (["--grpc-port", "9", "--grpc-infer-thread-count", "0"],
     "--grpc-infer-thread-count must be at least 1"),
    (["--grpc-port", "9", "--grpc-keepalive-time", "-5"], "--grpc-keepalive-time must not be negative"),
    (["--grpc-infer-response-compression-level", "med"], "invalid choice: 'med'"),
])
def test_bad_flags_are_refused(tmp_path, args, words):
    proc = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                           str(tmp_path), "--name", unique_name("t"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


def test_allow_grpc_false_serves_no_grpc(server_factory):
    port = free_port()
    server = server_factory(models=("simple",), args=["--grpc-port", port, "--allow-grpc", "false"])
    assert "gRPC service" not in server.log() and not grpc_fronts(server)


def test_server_options_carry_the_flags():
    from shmserve.front.grpc import server_options

    boot = {"arena_bytes": 1 << 20, "grpc_options": {
        "channel": {"grpc.keepalive_time_ms": 5000, "grpc.http2.max_ping_strikes": 3},
        "compression_level": 2}}
    options, level = dict(server_options(boot)[0]), server_options(boot)[1]
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.keepalive_time_ms"] == 5000 and options["grpc.http2.max_ping_strikes"] == 3
    assert options["grpc.default_compression_level"] == 2 and level == 2
    assert "grpc.default_compression_level" not in dict(server_options({"arena_bytes": 1})[0])


def _without_raw(message):
    copy = pb.ModelInferRequest()
    copy.CopyFrom(message)
    copy.ClearField("raw_input_contents")
    return copy


def test_read_infer_request_reads_what_protobuf_reads():
    """The inference RPCs' deserializer splits a large request's raw contents off as
    views of the received bytes: the same message and contents as protobuf's parse,
    wherever the raw contents stand, small requests included; a damaged message (cut
    anywhere, bytes flipped) is protobuf's: the same message or the same error."""
    from google.protobuf.message import DecodeError
    from shmserve.front.grpc import SPLIT_MIN_BYTES, read_infer_request

    rng = np.random.default_rng(0)
    req = pb.ModelInferRequest(model_name="m", model_version="2", id="x")
    req.parameters["sequence_id"].int64_param = 300
    req.parameters["f"].double_param = 0.5
    for i, n in enumerate((SPLIT_MIN_BYTES, 3, 0, 200)):
        req.inputs.add(name=f"I{i}", datatype="UINT8", shape=[n])
        req.raw_input_contents.append(rng.bytes(n))
    req.outputs.add(name="O").parameters["classification"].int64_param = 2
    wire = req.SerializeToString()
    raw_first = b"".join(pb.ModelInferRequest(raw_input_contents=[r]).SerializeToString()
                         for r in req.raw_input_contents) + _without_raw(req).SerializeToString()
    small = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"ab"]).SerializeToString()
    for data in (wire, raw_first, small):
        message, raw = read_infer_request(data)
        expected = pb.ModelInferRequest.FromString(data)
        assert [bytes(r) for r in raw] == list(expected.raw_input_contents)
        assert _without_raw(message) == _without_raw(expected)
    damaged = [wire[:cut] for cut in (1, 5, len(wire) // 2, len(wire) - 1)]
    for at in rng.integers(0, 600, 40):  # the fields before the large contents
        flipped = bytearray(wire)
        flipped[at] ^= 0xFF
        damaged.append(bytes(flipped))
    for data in damaged:
        try:
            expected = pb.ModelInferRequest.FromString(data)
        except DecodeError:
            with pytest.raises(DecodeError):
                read_infer_request(data)
            continue
        message, raw = read_infer_request(data)
        assert [bytes(r) for r in raw] == list(expected.raw_input_contents)
        assert _without_raw(message) == _without_raw(expected)


def test_engine_killed_answers_unavailable(server_factory):
    """The coordinator SIGKILLed while a gRPC request waits on a model: its fronts die
    with it, so the caller gets UNAVAILABLE at once, not a hang."""
    def with_sleeper(repo):
        write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,),
                                                   dynamic_batching=None), helpers.SLEEPER_CODE)

    server, client, port = start_grpc(server_factory, models=(), setup=with_sleeper)
    fronts = grpc_fronts(server)
    try:
        inp = tg.InferInput("INPUT0", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[30.0]], np.float32))
        own = server.client(arena_bytes=1 << 16)  # sees the request in flight
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: tg.InferenceServerClient(f"127.0.0.1:{port}")
                                  .infer("sleeper", [inp]))
            in_flight = lambda: any(row["pid"] in fronts and row["slots_in_use"]  # noqa: E731
                                    for row in own.server_status()["clients"])
            assert poll_until(lambda: waiting.done() or in_flight(), 20), server.log()
            assert not waiting.done(), waiting.exception()
            server.kill()
            server.proc.wait(10)
            with pytest.raises(InferenceServerException) as e:
                waiting.result(timeout=20)  # an error, not a hang
            assert e.value.status() == "StatusCode.UNAVAILABLE", e.value
        assert poll_until(lambda: not any(psutil.pid_exists(p) and
                                          psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                          for p in fronts), 10)
        assert rpc_error(client.is_server_live).status() == "StatusCode.UNAVAILABLE"
    finally:
        client.close()


def perf_analyzer_binary() -> str | None:
    """perf_analyzer on PATH or beside this Python, if it runs on this machine (the
    PyPI wheel's binary needs glibc 2.38)."""
    path = shutil.which("perf_analyzer") or shutil.which(
        "perf_analyzer", path=os.path.dirname(sys.executable))
    if path is None:
        return None
    probe = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return path if "GLIBC" not in probe.stderr and probe.returncode in (0, 1) else None


def test_perf_analyzer(server_factory):
    binary = perf_analyzer_binary()
    if binary is None:
        pytest.skip("perf_analyzer is not installed or does not run here (PyPI's "
                    "perf-analyzer >= 2.58 ships a binary built for glibc 2.38; older "
                    "releases are an empty placeholder)")
    server, client, port = start_grpc(server_factory)
    client.close()
    proc = subprocess.run([binary, "-m", "simple", "-u", f"localhost:{port}", "-i", "grpc",
                           "--concurrency-range", "1:2", "--measurement-interval", "1000"],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Concurrency: 2, throughput:" in proc.stdout, proc.stdout
    assert "error" not in proc.stdout.lower(), proc.stdout
