"""Decoupled models (model_transaction_policy { decoupled: true }): 0..n responses per
request through request.get_response_sender(), read by Client.infer_stream (and its
async form) over the slot protocol of docs/protocol.md section 6a."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import numpy as np
import pytest
from helpers import python_config, wait_until, write_model
from test_cpp_client import _run, cpp_build  # noqa: F401 (cpp_build: the session's C++ build)

import shmserve
from shmserve import errors

STREAM_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
model_transaction_policy {{ decoupled: true }}
'''

# n = IN; the request parameter "mode" picks the behaviour, "marker" a file where the
# model writes what it saw (cancellation, the error of a send after the final flag).
STREAM_CODE = '''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(i):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            params = json.loads(request.parameters())
            mode, marker = params.get("mode", ""), params.get("marker", "")
            if mode == "raise":
                raise ValueError("the model failed on purpose")
            if mode == "return_list":
                return [response(0)]
            if mode == "die":  # the worker process dies mid-stream
                request.get_response_sender().send(response(0))
                import os
                os._exit(7)
            if mode == "drop":  # the sender goes without its final flag
                request.get_response_sender().send(response(0))
                continue
            sender = request.get_response_sender()
            if mode == "thread":  # answered after execute() returned
                threading.Thread(target=self.stream, args=(sender, n, mode, marker)).start()
            else:
                self.stream(sender, n, mode, marker)
        return None

    def stream(self, sender, n, mode, marker):
        if mode == "thread":
            time.sleep(0.05)
        if mode == "until_cancelled":
            i = 0
            while not sender.is_cancelled() and i < 20000:
                sender.send(response(i))
                i += 1
                time.sleep(0.001)
            if marker:
                with open(marker, "w") as f:
                    f.write(f"cancelled after {i}" if sender.is_cancelled() else "never cancelled")
            sender.send(flags=FINAL)
            return
        for i in range(n):
            if mode == "error_mid" and i == 1:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("response 1 failed", pb_utils.TritonError.INVALID_ARG)))
                continue
            last = mode == "final_with_last" and i == n - 1
            sender.send(response(i), flags=FINAL if last else 0)
        if mode != "final_with_last" or n == 0:
            sender.send(flags=FINAL)
        if mode == "after_final":
            try:
                sender.send(response(99))
                said = "no error"
            except pb_utils.TritonModelException as e:
                said = str(e)
            with open(marker, "w") as f:
                f.write(said)
'''


def write_repository(repo):
    write_model(repo, "stream", STREAM_CONFIG.format(name="stream"), STREAM_CODE)
    write_model(repo, "identity", python_config("identity", dims=(-1,)), '''
class TritonPythonModel:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers import module_server
    yield from module_server(tmp_path_factory, write_repository, "dec")


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setenv("SHMSERVE_RUNTIME_DIR", str(server.runtime_dir))
    c = shmserve.Client(server.name, arena_bytes=1 << 20)
    yield c
    c.close()


def values(responses) -> list[int]:
    return [int(r["OUT"][0]) for r in responses]


def n_in(n: int) -> dict:
    return {"IN": np.array([n], np.int32)}


def test_streams_n_responses_then_the_final_flag_alone(client):
    got = list(client.infer_stream("stream", n_in(5), timeout=30))
    assert values(got) == [0, 1, 2, 3, 4]
    assert [r.index for r in got] == [0, 1, 2, 3, 4]
    assert not any(r.final for r in got)  # the final flag came alone
    assert client.engine.counters["slots_busy"] == 0


def test_the_last_response_may_carry_the_final_flag(client):
    got = list(client.infer_stream("stream", n_in(3), timeout=30,
                                   parameters={"mode": "final_with_last"}))
    assert values(got) == [0, 1, 2]
    assert [r.final for r in got] == [False, False, True]


def test_zero_responses_only_the_final_flag(client):
    assert list(client.infer_stream("stream", n_in(0), timeout=30)) == []


def test_many_responses_in_one_stream(client):
    assert values(client.infer_stream("stream", n_in(500), timeout=30)) == list(range(500))


def test_an_error_response_mid_stream_reaches_the_caller_and_the_stream_goes_on(client):
    got = list(client.infer_stream("stream", n_in(3), timeout=30, parameters={"mode": "error_mid"}))
    assert [r.index for r in got] == [0, 1, 2]
    assert got[1].error is not None and "response 1 failed" in str(got[1].error)
    assert isinstance(got[1].error, errors.InvalidArgumentError)
    with pytest.raises(errors.InvalidArgumentError, match="response 1 failed"):
        got[1]["OUT"]
    assert [int(got[0]["OUT"][0]), int(got[2]["OUT"][0])] == [0, 2]


def test_responses_sent_from_a_thread_after_execute_returned(client):
    assert values(client.infer_stream("stream", n_in(4), timeout=30,
                                      parameters={"mode": "thread"})) == [0, 1, 2, 3]


def test_a_send_after_the_final_flag_raises_in_the_model(client, tmp_path):
    marker = tmp_path / "said"
    got = list(client.infer_stream("stream", n_in(1), timeout=30,
                                   parameters={"mode": "after_final", "marker": str(marker)}))
    assert values(got) == [0]
    wait_until(marker.exists, 10, "the model's report")
    assert "final response was sent already" in marker.read_text()


def test_a_model_that_raises_fails_the_request(client):
    with pytest.raises(errors.InternalError, match="failed on purpose"):
        list(client.infer_stream("stream", n_in(2), timeout=30, parameters={"mode": "raise"}))


def test_execute_returning_responses_is_refused_naming_the_rule(client):
    with pytest.raises(errors.InternalError, match="must return None"):
        list(client.infer_stream("stream", n_in(1), timeout=30, parameters={"mode": "return_list"}))


def test_a_sender_dropped_without_the_final_flag_ends_the_request(client):
    stream = client.infer_stream("stream", n_in(1), timeout=30, parameters={"mode": "drop"})
    assert int(next(stream)["OUT"][0]) == 0
    with pytest.raises(errors.InternalError, match="without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL"):
        next(stream)


def test_a_worker_that_dies_mid_stream_fails_the_request_and_is_replaced(client):
    got = []
    with pytest.raises(errors.UnavailableError, match="died"):
        for r in client.infer_stream("stream", n_in(3), timeout=60, parameters={"mode": "die"}):
            got.append(int(r["OUT"][0]))
    assert got in ([], [0])  # response 0 is lost if the successor answered before it was read
    assert values(client.infer_stream("stream", n_in(2), timeout=60)) == [0, 1]
    assert client.engine.counters["slots_busy"] == 0


def test_infer_on_a_decoupled_model_is_refused_naming_it(client):
    with pytest.raises(errors.InvalidArgumentError, match="model 'stream' is decoupled.*infer_stream"):
        client.infer("stream", n_in(1), timeout=30)


def test_a_model_that_is_not_decoupled_streams_one_final_response(client):
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    got = list(client.infer_stream("identity", {"INPUT0": x}, timeout=30))
    assert len(got) == 1 and got[0].final and got[0].index == 0
    np.testing.assert_array_equal(got[0]["OUTPUT0"], x)


def test_cancellation_by_the_caller_reaches_the_model(client, tmp_path):
    marker = tmp_path / "cancelled"
    stream = client.infer_stream("stream", n_in(0), timeout=30,
                                 parameters={"mode": "until_cancelled", "marker": str(marker)})
    assert values([next(stream), next(stream), next(stream)]) == [0, 1, 2]
    stream.cancel()
    wait_until(marker.exists, 20, "the model to see the cancellation")
    assert marker.read_text().startswith("cancelled after")
    # the slot and its buffers come back with the model's final flag
    wait_until(lambda: client.engine._core.reap() or client.engine.counters["slots_busy"] == 0,
               20, "the cancelled request's slot to come back")
    assert values(client.infer_stream("stream", n_in(2), timeout=30)) == [0, 1]


def test_poll_and_stop_keep_the_request_until_its_final_flag(client, tmp_path):
    """poll() gives the next response (the request stays in flight between polls);
    stop() asks the model to stop and reading goes on until its final flag, after which
    the slot is free at once (what the gRPC front's reader relies on)."""
    marker = tmp_path / "stopped"
    stream = client.infer_stream("stream", n_in(0), timeout=30,
                                 parameters={"mode": "until_cancelled", "marker": str(marker)})
    first = None
    while first is None:
        first = stream.poll(1.0)
    assert values([first]) == [0]
    stream.stop()
    with pytest.raises(StopIteration):
        while True:
            stream.poll(1.0)  # what the model still sends is dropped
    assert marker.read_text().startswith("cancelled after")  # written before its final flag
    assert client.engine.counters["slots_busy"] == 0
    assert values(client.infer_stream("stream", n_in(2), timeout=30)) == [0, 1]


def _dies_mid_stream(runtime_dir: str, name: str, marker: str, ready) -> None:
    os.environ["SHMSERVE_RUNTIME_DIR"] = runtime_dir
    c = shmserve.Client(name, arena_bytes=1 << 20)
    stream = c.infer_stream("stream", n_in(0), timeout=30,
                            parameters={"mode": "until_cancelled", "marker": marker})
    next(stream)
    ready.set()
    time.sleep(60)


def test_a_caller_that_dies_mid_stream_leaks_nothing(client, server, tmp_path):
    marker = tmp_path / "dead"
    ready = multiprocessing.get_context("spawn").Event()
    child = multiprocessing.get_context("spawn").Process(
        target=_dies_mid_stream, args=(str(server.runtime_dir), server.name, str(marker), ready))
    child.start()
    try:
        assert ready.wait(60), "the child never got its first response"
        child.kill()
        child.join(10)
        # the model sees its caller gone as a cancellation and ends the stream
        wait_until(marker.exists, 30, "the model to see its caller gone")
        assert marker.read_text().startswith("cancelled after")
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
    assert values(client.infer_stream("stream", n_in(3), timeout=30)) == [0, 1, 2]
    wait_until(lambda: len(client.server_status()["clients"]) == 1, 30,
               "the dead caller's lease to be reclaimed")


def test_async_iterator(client):
    async def main():
        got = []
        async for r in client.infer_stream_async("stream", n_in(4), timeout=30):
            got.append(int(r["OUT"][0]))
        return got
    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_first_response_statistics_are_kept(client):
    list(client.infer_stream("stream", n_in(2), timeout=30))
    (stat,) = client.statistics("stream", histograms=True)
    assert stat["shmserve"]["histograms"]["first_response"]
    assert stat["inference_stats"]["success"]["count"] >= 1


def test_first_response_histogram_metric(client):
    """--metrics-config histogram_latencies=true: Triton's first-response histogram,
    from the same statistics (metrics.py)."""
    from prometheus_client.registry import CollectorRegistry

    from shmserve.server import metrics

    list(client.infer_stream("stream", n_in(1), timeout=30))
    stats = client.statistics(histograms=True)

    class Sampler:
        config = {**metrics.parse_metrics_config(["histogram_latencies=true"]),
                  "counter_latencies": False}
        cpu, gpus = None, []

    status = {"models": stats, "batcher": {"wakeups": {}, "restarts": 0}, "ring_depth": 0,
              "clients": []}
    collector = metrics.StatsCollector(lambda histograms: status, Sampler())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = metrics.exposition(registry).decode()
    assert "# TYPE nv_inference_first_response_histogram_ms histogram" in text
    lines = [ln for ln in text.splitlines()
             if ln.startswith("nv_inference_first_response_histogram_ms_count")]
    assert lines and all('model="stream"' in ln for ln in lines)  # decoupled models only
    assert float(lines[0].rsplit(" ", 1)[1]) >= 1
    assert 'nv_inference_first_response_histogram_ms_bucket{model="stream",version="1",le="+Inf"}' in text



def test_sender_checks_its_arguments_in_process():
    """pb_utils.InferenceResponseSender against a recording stream: what reaches the
    worker's ResponseStream, and what is refused in the model."""
    from types import SimpleNamespace

    from shmserve import pb_utils

    class Recorder:
        def __init__(self):
            self.sent, self.failed = [], []
            self.worker = SimpleNamespace(spec=SimpleNamespace(name="m"))

        def send(self, outputs, error, final):
            self.sent.append((outputs, error, final))

        def cancelled(self):
            return False

        def fail(self, status, message):
            self.failed.append(message)

    stream = Recorder()
    sender = pb_utils.InferenceResponseSender(stream)
    out = pb_utils.Tensor("OUT", np.array([1], np.int32))
    sender.send(pb_utils.InferenceResponse([out]))
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("no")))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert [(list(o) if o else o, e, f) for o, e, f in stream.sent] == [
        (["OUT"], None, False), (None, (shmserve.protocol.Status.INTERNAL, "no"), False),
        (None, None, True)]
    with pytest.raises(pb_utils.TritonModelException, match="a response is needed"):
        sender.send()
    with pytest.raises(pb_utils.TritonModelException, match="flags 0x4"):
        sender.send(pb_utils.InferenceResponse([out]), flags=4)
    with pytest.raises(pb_utils.TritonModelException, match="must be a pb_utils.InferenceResponse"):
        sender.send({"OUT": np.zeros(1)})
    assert not sender.is_cancelled()
    del sender  # dropped: the stream is told (it ignores it once final)
    assert stream.failed and "without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL" in stream.failed[0]

@pytest.mark.timeout(600)  # the session's C++ build (plain and sanitized) may run first
def test_cpp_client_streams(server, cpp_build):  # noqa: F811
    """The C++ client's infer_stream: a callback per response, an error response mid-
    stream, cancellation by returning false (clients/cpp/tests/test_client.cpp, mode
    "stream")."""
    r = _run([cpp_build / "shmserve_cpp_tests", "stream", "--socket", server.socket_path])
    assert "stream: 0 failures" in r.stdout
