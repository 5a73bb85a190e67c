"""Decoupled models over the network fronts, as Triton serves them: ModelStreamInfer
streams each response the model sends (tritonclient.grpc's start_stream,
async_stream_infer, stop_stream; tritonclient.grpc.aio's stream_infer), with Triton's
triton_final_response and triton_enable_empty_final_response parameters; error
responses, interleaved requests, a cancelled stream (the model sees is_cancelled(),
the front's slots come back); ModelInfer and HTTP infer refuse a decoupled model.
The model is tests/test_decoupled.py's."""
from __future__ import annotations

import asyncio
import queue

import numpy as np
import pytest

import helpers
from helpers import poll_until, python_config, write_model
from test_decoupled import STREAM_CODE, STREAM_CONFIG
from test_metrics import free_port
from test_sequence import STATE_ACC_CODE, seq_config

grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
import tritonclient.grpc.aio as tga  # noqa: E402
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import shmserve  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# Two instances: a request that streams until cancelled keeps one busy, the other
# serves the requests sent meanwhile.
CONFIG = STREAM_CONFIG.format(name="stream") + 'instance_group [ { count: 2 kind: KIND_CPU } ]\n'
REFUSED = "doesn't support models with decoupled transaction policy: model 'stream' is decoupled"


def write_repository(repo):
    write_model(repo, "stream", CONFIG, STREAM_CODE)
    write_model(repo, "seq", seq_config("seq", "direct { }"), STATE_ACC_CODE)
    write_model(repo, "identity", python_config("identity", dims=(-1,)), '''
class TritonPythonModel:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
''')


def _live(client) -> bool:
    try:
        return client.is_server_live()
    except Exception:
        return False


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """(server, gRPC port, HTTP port): one server with both fronts."""
    grpc_port, http_port = free_port(), free_port()

    def connect(server, port):
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        assert poll_until(lambda: _live(client), 60), server.log()
        return client

    for server, client, _ in helpers.front_server(
            tmp_path_factory, write_repository, "gdec", grpc_port,
            ["--grpc-port", str(grpc_port), "--http-port", str(http_port)], connect):
        yield server, grpc_port, http_port


@pytest.fixture
def client(front):
    c = tg.InferenceServerClient(f"127.0.0.1:{front[1]}")
    yield c
    c.close()


def stream_input(n: int):
    inp = tg.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([n], np.int32))
    return [inp]


class Stream:
    """A tritonclient stream whose callback queues (result, error)."""

    def __init__(self, client):
        self.client, self.answers = client, queue.Queue()
        client.start_stream(callback=lambda result, error: self.answers.put((result, error)))

    def send(self, n: int, request_id: str, **kw):
        self.client.async_stream_infer("stream", stream_input(n), request_id=request_id, **kw)

    def get(self):
        return self.answers.get(timeout=60)

    def close(self, cancel: bool = False) -> list:
        """Ends the stream; the answers not read yet."""
        self.client.stop_stream(cancel_requests=cancel)
        rest = []
        while not self.answers.empty():
            rest.append(self.answers.get())
        return rest


def final_flag(result) -> bool | None:
    params = result.get_response().parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else None


def out(result):
    return int(result.as_numpy("OUT")[0])


def slots_in_use(server) -> int:
    """Request slots not free over the server's clients (the fronts' leases)."""
    with shmserve.Client(server.name) as c:  # found through SHMSERVE_RUNTIME_DIR (front_server)
        return sum(row["slots_in_use"] for row in c.server_status()["clients"])


def test_each_response_is_a_stream_message(client):
    """n responses, each its own message with the request's id, triton_final_response
    false (the final flag came alone afterwards: no message for it by default)."""
    s = Stream(client)
    try:
        s.send(3, "r3")
        got = [s.get() for _ in range(3)]
    finally:
        rest = s.close()
    assert rest == []  # the final flag alone: nothing more
    assert all(e is None for _, e in got), got
    assert [out(r) for r, _ in got] == [0, 1, 2]
    assert {r.get_response().id for r, _ in got} == {"r3"}
    assert {r.get_response().model_name for r, _ in got} == {"stream"}
    assert [final_flag(r) for r, _ in got] == [False, False, False]


def test_empty_final_response_when_asked(client):
    """triton_enable_empty_final_response: the final flag sent alone is one more
    message, without outputs, triton_final_response true; none when the model sent the
    final flag with its last response; 0 responses: only that message (or nothing)."""
    s = Stream(client)
    try:
        s.send(2, "asked", enable_empty_final_response=True)
        got = [s.get() for _ in range(3)]
        s.send(2, "with_last", enable_empty_final_response=True,
               parameters={"mode": "final_with_last"})
        with_last = [s.get() for _ in range(2)]
        s.send(0, "zero", enable_empty_final_response=True)
        zero = s.get()
        s.send(0, "zero_unasked")
        s.send(1, "after")  # answered after the request that sent nothing
        after = s.get()
    finally:
        rest = s.close()
    assert rest == []
    assert all(e is None for _, e in got + with_last + [zero, after])
    assert [out(r) for r, _ in got[:2]] == [0, 1]
    assert [final_flag(r) for r, _ in got] == [False, False, True]
    last = got[2][0].get_response()
    assert (last.id, last.model_name, len(last.outputs)) == ("asked", "stream", 0)
    assert [out(r) for r, _ in with_last] == [0, 1]
    assert [final_flag(r) for r, _ in with_last] == [False, True]
    response = zero[0].get_response()
    assert (response.id, len(response.outputs), final_flag(zero[0])) == ("zero", 0, True)
    assert after[0].get_response().id == "after" and out(after[0]) == 0


def test_error_response_mid_stream(client):
    """An error response the model sends is an error message on the stream; the
    request's next responses and the stream's next requests follow."""
    s = Stream(client)
    try:
        s.send(3, "e", parameters={"mode": "error_mid"})
        got = [s.get() for _ in range(3)]
        s.send(1, "next")
        following = s.get()
        s.send(1, "raise", parameters={"mode": "raise"})  # the request's own error
        raised = s.get()
    finally:
        rest = s.close()
    assert rest == []
    assert got[0][1] is None and out(got[0][0]) == 0
    assert got[1][0] is None and "response 1 failed" in str(got[1][1])
    assert got[2][1] is None and out(got[2][0]) == 2
    assert following[1] is None and following[0].get_response().id == "next"
    assert raised[0] is None and "the model failed on purpose" in str(raised[1])


def test_requests_interleave_and_cancel(front, client, tmp_path):
    """Two requests on one stream: one that streams until cancelled, one sent while it
    streams; their responses interleave. stop_stream(cancel_requests=True) cancels
    the one in flight: the model sees is_cancelled(), the front's slots come back."""
    server = front[0]
    marker = tmp_path / "cancelled"
    s = Stream(client)
    cancelled = False
    try:
        s.send(0, "long", parameters={"mode": "until_cancelled", "marker": str(marker)})
        seen = [s.get()]
        s.send(2, "short", enable_empty_final_response=True)
        while not (seen[-1][0] is not None and seen[-1][0].get_response().id == "short"
                   and final_flag(seen[-1][0])):
            seen.append(s.get())
        seen.append(s.get())  # the long request goes on after the short one's end
        s.close(cancel=True)
        cancelled = True
    finally:
        if not cancelled:
            s.close(cancel=True)
    assert all(e is None for _, e in seen), seen
    ids = [r.get_response().id for r, _ in seen]
    assert ids[0] == "long" and ids[-1] == "long" and ids.count("short") == 3
    longs = [out(r) for r, _ in seen if r.get_response().id == "long"]
    assert longs == list(range(len(longs)))  # one request's responses stay in order
    assert poll_until(marker.exists, 60), server.log()
    assert marker.read_text().startswith("cancelled after"), marker.read_text()
    assert poll_until(lambda: slots_in_use(server) == 0, 60), server.log()


def test_cancelled_streams_leak_nothing(front):
    """More cancelled streams than a front's lease has slots: each request's slot
    comes back (the next streams are served)."""
    server, port, _ = front
    for i in range(40):
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            s = Stream(client)
            s.send(0, f"c{i}", parameters={"mode": "until_cancelled"})
            result, error = s.get()
            assert error is None and result.get_response().id == f"c{i}"
            s.close(cancel=True)
        finally:
            client.close()
    assert poll_until(lambda: slots_in_use(server) == 0, 60), server.log()


def test_stream_of_a_model_that_is_not_decoupled(client):
    """A model that answers once: one message, triton_final_response true."""
    s = Stream(client)
    try:
        inp = tg.InferInput("INPUT0", [1, 2], "FP32")
        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        client.async_stream_infer("identity", [inp], request_id="once",
                                  enable_empty_final_response=True)
        result, error = s.get()
    finally:
        rest = s.close()
    assert error is None and rest == []
    assert result.get_response().id == "once" and final_flag(result) is True


def test_sequences_on_one_stream_run_in_its_order(client):
    """Sequences driven over one stream, the way tritonclient users do: every request
    sent without waiting, sequences interleaved, the first requests while the front
    still learns the model (is it decoupled?). The requests are sent to the engine in
    the stream's order, so each answer is its sequence's running sum."""
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    sequences, steps = (11, 12, 13, 14), 5
    try:
        for step in range(steps):
            for corrid in sequences:
                inp = tg.InferInput("INPUT0", [1, 1], "INT64")
                inp.set_data_from_numpy(np.array([[corrid * step]], np.int64))
                client.async_stream_infer("seq", [inp], request_id=f"{corrid}-{step}",
                                          sequence_id=corrid, sequence_start=step == 0,
                                          sequence_end=step == steps - 1)
        got = [answers.get(timeout=60) for _ in range(len(sequences) * steps)]
    finally:
        client.stop_stream()
    assert all(e is None for _, e in got), [e for _, e in got if e is not None]
    sums = {r.get_response().id: int(r.as_numpy("OUTPUT0")[0, 0]) for r, _ in got}
    assert sums == {f"{c}-{k}": c * k * (k + 1) // 2 for c in sequences for k in range(steps)}


def test_aio_stream_infer(front):
    """tritonclient.grpc.aio's stream_infer on a decoupled model (that client cannot
    ask for the empty final response: it refuses "triton_" parameters): the stream
    ends once both requests had their final flag."""
    async def main():
        client = tga.InferenceServerClient(f"127.0.0.1:{front[1]}")
        try:
            async def requests():
                yield {"model_name": "stream", "inputs": stream_input(4), "request_id": "a"}
                yield {"model_name": "stream", "inputs": stream_input(2), "request_id": "b",
                       "parameters": {"mode": "final_with_last"}}

            got = {}
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                got.setdefault(result.get_response().id, []).append(
                    (out(result), final_flag(result)))
            return got
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == {"a": [(0, False), (1, False), (2, False), (3, False)],
                   "b": [(0, False), (1, True)]}


def test_raw_stream_parameters(front):
    """The stub's view: triton_enable_empty_final_response must be a bool (Triton's
    words), and it does not reach the model as a parameter of its own."""
    channel = grpc.insecure_channel(f"127.0.0.1:{front[1]}")
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def request(rid, value):
            r = pb.ModelInferRequest(model_name="stream", id=rid)
            t = r.inputs.add(name="IN", datatype="INT32", shape=[1])
            t.contents.int_contents.append(1)
            if value is not None:
                r.parameters["triton_enable_empty_final_response"].CopyFrom(value)
            return r

        answers = list(stub.ModelStreamInfer(iter([
            request("bad", pb.InferParameter(int64_param=1)),
            request("good", pb.InferParameter(bool_param=True))])))
    finally:
        channel.close()
    bad = [a for a in answers if a.infer_response.id == "bad"]
    good = [a for a in answers if a.infer_response.id == "good"]
    assert len(bad) == 1 and bad[0].error_message == (
        "invalid value type for 'triton_enable_empty_final_response' parameter, "
        "expected bool_param")
    assert [a.error_message for a in good] == ["", ""]
    assert [a.infer_response.parameters["triton_final_response"].bool_param
            for a in good] == [False, True]
    assert len(good[0].infer_response.outputs) == 1 and not good[1].infer_response.outputs


def test_unary_infer_refuses_a_decoupled_model(front, client):
    """ModelInfer and HTTP infer answer once: as Triton, they refuse a decoupled model
    (UNIMPLEMENTED, 501), naming it."""
    with pytest.raises(InferenceServerException) as e:
        client.infer("stream", stream_input(1))
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    assert e.value.message().startswith("ModelInfer RPC " + REFUSED), e.value.message()
    http = th.InferenceServerClient(f"127.0.0.1:{front[2]}")
    try:
        inp = th.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as e:
            http.infer("stream", [inp])
        assert e.value.status() == "501"
        assert e.value.message().startswith("HTTP end point " + REFUSED), e.value.message()
        inp = th.InferInput("INPUT0", [1, 2], "FP32")
        inp.set_data_from_numpy(np.ones((1, 2), np.float32))
        assert http.infer("identity", [inp]).as_numpy("OUTPUT0").shape == (1, 2)
    finally:
        http.close()
