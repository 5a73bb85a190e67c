"""Request options (protocol 3: priority, timeout_us, parameters) and dynamic batching
complete (issue 11): priority levels reorder the queue, queue timeouts reject with
Triton's message or DELAY a request behind the others, allow_timeout_override,
preserve_ordering with two instances, parameters from the Python client (both paths),
the HTTP front and a BLS call to models of both python APIs, and hostile parameter
bytes answered with an error while the server keeps serving.

Determinism: a model holds its instance on a gate (a file the test creates) while the
test fills the queue, and records the order it ran its batches in; nothing here
asserts a duration."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from helpers import (IDENTITY_CODE, PARAMS_CODE, RawLease, python_config, wait_until,
                     write_model)
from shmserve import errors
from shmserve import protocol as P
from shmserve.errors import ConfigError
from shmserve.protocol import LAYOUT as L
from shmserve.server.repository import load_model
from shmserve.server.scheduling import Pending, make_scheduler
from shmserve.server.repository import ModelSpec, TensorSpec

pytestmark = pytest.mark.timeout(180)

# Triton's python API: logs each batch's request tags (parameter "tag") in the model
# directory, and holds the instance while a request of the batch has "block" until
# the test creates the file "gate" there.
GATED_RECORDER_CODE = '''
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.dir = args["model_repository"]

    def execute(self, requests):
        params = [json.loads(r.parameters()) for r in requests]
        with open(os.path.join(self.dir, "batches.jsonl"), "a") as f:
            f.write(json.dumps([p.get("tag") for p in params]) + "\\n")
        if any(p.get("block") for p in params):
            gate, until = os.path.join(self.dir, "gate"), time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < until:
                time.sleep(0.002)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

# The numpy-dict API with per-request parameters (execute(inputs, requests)): logs
# "start"/"end" lines per batch; holds on the gate like the recorder.
GATED_NUMPY_CODE = '''
import json, os, time

class TritonPythonModel:
    def initialize(self, args):
        self.dir = args["model_repository"]

    def log(self, what, tags):
        with open(os.path.join(self.dir, "log.jsonl"), "a") as f:
            f.write(json.dumps([what, tags]) + "\\n")

    def execute(self, inputs, requests):
        tags = [p.get("tag") for _, p in requests]
        self.log("start", tags)
        if any(p.get("block") for _, p in requests):
            gate, until = os.path.join(self.dir, "gate"), time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < until:
                time.sleep(0.002)
        self.log("end", tags)
        return {"OUTPUT0": inputs["INPUT0"]}
'''

# The numpy-dict API: each row of OUTPUT0 is parameter "v" of the request it belongs to.
ROWS_CODE = '''
import numpy as np

class TritonPythonModel:
    def execute(self, inputs, requests):
        v = [np.full(rows, float(p.get("v", -1)), np.float32) for rows, p in requests]
        return {"OUTPUT0": np.concatenate(v).reshape(-1, 1)}
'''

X = np.ones((1, 1), np.float32)


def lines(path: Path) -> list:
    return [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []


# -- priorities, timeouts, DELAY, override (one gated instance) ----------------------

PRIO_CONFIG = """{
  max_queue_delay_microseconds: 0
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { default_timeout_microseconds: 60000000 timeout_action: DELAY
                         allow_timeout_override: true }
  priority_queue_policy { key: 1 value { default_timeout_microseconds: 60000000
                                         timeout_action: DELAY } }
  priority_queue_policy { key: 3 value { default_timeout_microseconds: 60000000
                                         allow_timeout_override: true } }
}"""


def test_priorities_reorder_and_queue_timeouts_reject_or_delay(server_factory):
    """Level 1 refuses the per-request timeout, level 2 (the default) DELAYs, level 3
    REJECTs. The instance is held by a blocker while the queue fills, in this arrival
    order: a (3), b (0 = default 2), x (2, 1 ms: delayed), r (3, 1 ms: rejected), c (1),
    n (1, 1 ms: override refused, stays), d (2), f (9 = out of range: default 2)."""
    def setup(repo):
        write_model(repo, "prio", python_config("prio", max_batch_size=1,
                                                dynamic_batching=PRIO_CONFIG), GATED_RECORDER_CODE)

    server = server_factory(models=(), setup=setup)
    model_dir = server.repo / "prio"
    c = server.client()
    blocker = c.submit("prio", {"INPUT0": X}, priority=1, parameters={"tag": "block", "block": True})
    wait_until(lambda: lines(model_dir / "batches.jsonl") == [["block"]], 30, "the blocker running")
    sent = {}
    for tag, priority, timeout_us in [("a", 3, 0), ("b", 0, 0), ("x", 2, 1000), ("r", 3, 1000),
                                      ("c", 1, 0), ("n", 1, 1000), ("d", 2, 0), ("f", 9, 0)]:
        sent[tag] = c.submit("prio", {"INPUT0": X}, priority=priority, timeout_us=timeout_us,
                             parameters={"tag": tag})
    # r's own 1 ms timeout (allowed on level 3) rejects it while the blocker holds the
    # instance; x's (submitted before r, so due before it) has been applied by then.
    with pytest.raises(errors.UnavailableError) as e:
        sent["r"].result(timeout=60)
    assert str(e.value).startswith("Request timeout expired"), e.value
    assert "timed out in the queue after 1000 us, priority level 3" in str(e.value)
    assert not any(f.done() for tag, f in sent.items() if tag != "r")
    (model_dir / "gate").touch()
    blocker.result(timeout=60)
    for tag, f in sent.items():
        if tag != "r":
            assert f.result(timeout=60)["OUTPUT0"].tolist() == [[1.0]], tag
    order = [b[0] for b in lines(model_dir / "batches.jsonl")]
    assert order == ["block", "c", "n", "b", "d", "f", "x", "a"], order
    stats = c.statistics("prio")[0]
    assert stats["shmserve"]["failures"]["REJECTED"] == 1


def spec_of(**kw) -> ModelSpec:
    t = TensorSpec("INPUT0", 11, (-1,))
    base = dict(name="m", version=1, backend="python", path="/x", max_batch_size=8, inputs=(t,),
                outputs=(t,), instance_count=1, dynamic_batching=True, preferred_batch_sizes=(),
                max_queue_delay_us=0, parameters={}, config_text="")
    return ModelSpec(**{**base, **kw})


def pending(i: int, priority=0, timeout_us=0, at_us=0) -> Pending:
    return Pending(i, 1, b"k", at_us * 1000, None, 0, 0, priority, timeout_us)


def test_timeout_override_follows_triton_only_shorter_and_only_where_allowed():
    """Triton's rule (PriorityQueue::PolicyQueue::Enqueue): a request's timeout counts
    where allow_timeout_override is set and only if shorter than the default."""
    q = make_scheduler(spec_of(queue_timeout_us=100, allow_timeout_override=True))
    for i, t in enumerate((50, 500, 0)):
        assert q.enqueue(pending(i, timeout_us=t)) is None
    expired, next_at = q.expire(60_000)
    assert [r.pending.shadow for r in expired] == [0] and next_at == 100_000
    assert [r.pending.shadow for r in q.expire(100_000)[0]] == [1, 2]
    q = make_scheduler(spec_of(queue_timeout_us=100))  # override not allowed
    q.enqueue(pending(0, timeout_us=50))
    assert q.expire(60_000) == ([], 100_000)
    q = make_scheduler(spec_of(allow_timeout_override=True))  # no default: Triton ignores it
    q.enqueue(pending(0, timeout_us=50))
    assert q.expire(10**12) == ([], None) and len(q) == 1


def test_delay_moves_a_request_behind_its_level_and_keeps_it():
    q = make_scheduler(spec_of(max_batch_size=1, queue_timeout_us=100, queue_delay_on_timeout=True))
    q.enqueue(pending(0, at_us=0))
    q.enqueue(pending(1, at_us=200))
    assert q.expire(150_000) == ([], 300_000)  # 0 is delayed, not rejected
    assert [p.shadow for p in q.queue] == [1, 0] and len(q) == 2
    assert [b[0].shadow for b in q.next_batches(400_000, 1)[0]] == [1]
    assert [b[0].shadow for b in q.next_batches(400_000, 1)[0]] == [0]
    assert len(q) == 0 and q.expire(10**12) == ([], None)


def test_max_queue_size_is_per_priority_level():
    q = make_scheduler(spec_of(priority_levels=2, default_priority_level=2, max_queue_size=1,
                               priority_queue_policies=((1, 2, 0, False, False),)))
    assert q.enqueue(pending(0, priority=1)) is None and q.enqueue(pending(1, priority=1)) is None
    assert q.enqueue(pending(2, priority=1)).status == P.Status.BUSY
    assert q.enqueue(pending(3)) is None
    refused = q.enqueue(pending(4, priority=2))
    assert refused.status == P.Status.BUSY and "max_queue_size 1" in refused.message
    assert [p.shadow for p in q.queue] == [0, 1, 3]


def test_priority_config_loads_and_is_checked(tmp_path, caplog):
    path = write_model(tmp_path, "m", python_config("m", dynamic_batching=PRIO_CONFIG.replace(
        "max_queue_delay_microseconds: 0", "preserve_ordering: true")), IDENTITY_CODE)
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        (spec,) = load_model(path)
    assert not caplog.records, caplog.text  # nothing of it is ignored any more
    assert (spec.priority_levels, spec.default_priority_level, spec.preserve_ordering) == (3, 2, True)
    assert spec.priority_queue_policies == ((1, 0, 60_000_000, True, False),
                                            (3, 0, 60_000_000, False, True))
    assert spec.queue_delay_on_timeout and spec.allow_timeout_override
    for config, words in [("{ priority_levels: 2 }", "default_priority_level 0 must lie in 1..priority_levels (2)"),
                          ("{ default_priority_level: 1 }", "needs priority_levels"),
                          ("{ priority_levels: 2 default_priority_level: 1 priority_queue_policy "
                           "{ key: 3 value { max_queue_size: 1 } } }", "key 3 must lie in 1..priority_levels (2)")]:
        bad = write_model(tmp_path / "bad", "m", python_config("m", dynamic_batching=config),
                          IDENTITY_CODE)
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_model(bad)


# -- preserve_ordering: two instances ------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
def test_preserve_ordering_with_two_instances(server_factory, ordered):
    """The first request holds instance A; the second runs on instance B and finishes.
    With preserve_ordering its answer waits for the first's; without, it comes at once."""
    def setup(repo):
        write_model(repo, "order", python_config(
            "order", max_batch_size=1, dynamic_batching="{ preserve_ordering: %s }" % str(ordered).lower(),
            extra="instance_group [ { count: 2 kind: KIND_CPU } ]"), GATED_NUMPY_CODE)

    server = server_factory(models=(), setup=setup)
    model_dir = server.repo / "order"
    c = server.client()
    first = c.submit("order", {"INPUT0": X}, parameters={"tag": "first", "block": True})
    wait_until(lambda: lines(model_dir / "log.jsonl") == [["start", ["first"]]], 30, "first running")
    second = c.submit("order", {"INPUT0": X * 2}, parameters={"tag": "second"})
    wait_until(lambda: ["end", ["second"]] in lines(model_dir / "log.jsonl"), 30, "second executed")
    if ordered:
        time.sleep(0.3)  # ample time for an answer that was not held back
        assert not second.done(), "preserve_ordering: the second answer overtook the first"
    else:
        assert second.result(timeout=30)["OUTPUT0"].tolist() == [[2.0]]
        assert not first.done()
    (model_dir / "gate").touch()
    assert first.result(timeout=60)["OUTPUT0"].tolist() == [[1.0]]
    assert second.result(timeout=60)["OUTPUT0"].tolist() == [[2.0]]
    # Later requests are not held by anything left over.
    for i in range(6):
        assert c.infer("order", {"INPUT0": X * i}, parameters={"tag": i})["OUTPUT0"][0, 0] == i


# -- parameters: every way in --------------------------------------------------------


PARAMS = {"tag": "py", "n": 7, "flag": True, "x": 1.5, "big": -(1 << 62)}


def test_parameters_round_trip_on_both_python_paths(client):
    want = json.dumps(PARAMS)
    got = client.infer("params", {"INPUT0": X}, parameters=PARAMS, priority=1, timeout_us=10**7)
    assert got["OUTPUT0"].tolist() == [[want.encode()]]
    assert client.submit("params", {"INPUT0": X}, parameters=PARAMS).result(30)["OUTPUT0"][0, 0] \
        == want.encode()
    before = client.engine.counters
    # A non-contiguous input takes the Python (reference) path: the same bytes on the wire.
    strided = np.ones((2, 2), np.float32)[:, ::2]
    assert client.infer("params", {"INPUT0": strided}, parameters=PARAMS)["OUTPUT0"][0, 0] \
        == want.encode()
    assert client.engine.counters["python"] == before["python"] + 1
    assert client.engine.counters["c"] == before["c"]  # and the two before took the C path
    assert before["c"] >= 2
    assert client.infer("params", {"INPUT0": X})["OUTPUT0"][0, 0] == b"{}"
    for bad, words in [({"": 1}, "non-empty strings"), ({"a": [1]}, "parameter 'a' is a list"),
                       ({"a": 1 << 64}, "outside int64"), ("a=1", "must be a mapping")]:
        with pytest.raises(errors.InvalidArgumentError, match=words):
            client.infer("params", {"INPUT0": X}, parameters=bad)
    with pytest.raises(errors.InvalidArgumentError, match="priority must be an integer"):
        client.infer("params", {"INPUT0": X}, priority=-1)


def test_numpy_dict_models_get_each_requests_parameters_by_rows(server_factory):
    def setup(repo):
        write_model(repo, "rows", python_config("rows", max_batch_size=8, out_dims=(1,)), ROWS_CODE)

    c = server_factory(models=(), setup=setup).client()
    out = c.infer("rows", {"INPUT0": np.ones((3, 2), np.float32)}, parameters={"v": 5})
    assert out["OUTPUT0"].tolist() == [[5.0]] * 3
    assert c.infer("rows", {"INPUT0": np.ones((2, 2), np.float32)})["OUTPUT0"].tolist() == [[-1.0]] * 2


BLS_CODE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0")
            params = dict(json.loads(r.parameters()), via="bls")
            reply = pb_utils.InferenceRequest(model_name="params", inputs=[x],
                                              requested_output_names=["OUTPUT0"],
                                              parameters=params).exec()
            if reply.has_error():
                raise pb_utils.TritonModelException(reply.error().message())
            out.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(reply, "OUTPUT0")]))
        return out
'''


def test_bls_requests_forward_parameters(server_factory):
    def setup(repo):
        write_model(repo, "params", python_config("params", out_dtype="BYTES", out_dims=(1,)),
                    PARAMS_CODE)
        write_model(repo, "caller", python_config("caller", out_dtype="BYTES", out_dims=(1,)),
                    BLS_CODE)

    c = server_factory(models=(), setup=setup).client()
    got = c.infer("caller", {"INPUT0": X}, parameters={"tag": "outer"})["OUTPUT0"][0, 0]
    assert json.loads(got) == {"tag": "outer", "via": "bls"}


def test_http_front_forwards_parameters_and_maps_priority_and_timeout(server_factory):
    from test_http_front import raw, start_http

    def setup(repo):
        write_model(repo, "params", python_config("params", out_dtype="BYTES", out_dims=(1,)),
                    PARAMS_CODE)

    server, http_client, port = start_http(server_factory, models=(), setup=setup)
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}],
                "parameters": {"tag": "http", "n": 3, "priority": 1, "timeout": 5000000}}
        status, reply = raw(port, "POST", "/v2/models/params/infer", json.dumps(body).encode())
        assert status == 200, reply
        assert json.loads(reply["outputs"][0]["data"][0]) == {"tag": "http", "n": 3}
        for params, words in [({"priority": -1}, "parameter 'priority' must be a non-negative"),
                              ({"timeout": "soon"}, "parameter 'timeout' must be"),
                              ({"sequence_id": 3}, "sequence extension"),
                              ({"x": [1, 2]}, "parameter 'x' is a list")]:
            status, reply = raw(port, "POST", "/v2/models/params/infer",
                                json.dumps({**body, "parameters": params}).encode())
            assert status == 400 and words in reply["error"], (params, reply)
    finally:
        http_client.close()


# -- hostile bytes ---------------------------------------------------------------------


def test_hostile_request_options_are_answered_and_the_server_keeps_serving(main_server, client):
    raw = RawLease(main_server.socket_path)
    try:
        model_id = raw.model_ids["params"]
        data = raw.data_offset
        x = np.ones((1, 1), np.float32).tobytes()
        raw.buf[data:data + 4] = x
        inputs = [(0, P.DataType.FP32, 2, data, 4, (1, 1))]
        outputs = [(0, 0, 0, data + 4096, 4096, ())]
        params_at = data + 8192

        def send(options: dict, payload: bytes = b""):
            raw.buf[params_at:params_at + len(payload)] = payload
            gen = raw.write_raw_request(0, model_id, 1, 1, inputs, outputs)
            req = raw.slot_offset(0) + L["slot.request"]
            for field, value in options.items():
                raw._put(req, "request", field, value)
            assert raw.push(0, gen) == P.RingResult.OK
            return raw.wait_done(0)

        def at(payload: bytes) -> dict:
            return {"parameters_offset": params_at, "parameters_bytes": len(payload)}

        cases = [
            (b"\xc1", at(b"\xc1"), P.Status.INVALID_ARG, "request parameters are not valid msgpack"),
            (b"\x93\x01\x02\x03", at(b"\x93\x01\x02\x03"), P.Status.INVALID_ARG,
             "request parameters must be a msgpack map, got list"),
            (b"\x81\x01\x02", at(b"\x81\x01\x02"), P.Status.INVALID_ARG, "not valid msgpack"),
            (msgpack.packb({"a": {"b": 1}}), at(msgpack.packb({"a": {"b": 1}})), P.Status.INVALID_ARG,
             "parameter 'a' is a dict"),
            (msgpack.packb({"a": b"bin"}, use_bin_type=True), at(msgpack.packb({"a": b"bin"}, use_bin_type=True)),
             P.Status.INVALID_ARG, "not valid msgpack"),
            (b"\xdf\xff\xff\xff\xff", at(b"\xdf\xff\xff\xff\xff"), P.Status.INVALID_ARG, "not valid msgpack"),
            (b"", {"parameters_offset": raw.arena_bytes - 2, "parameters_bytes": 16},
             P.Status.BAD_DESCRIPTOR, "request parameters ["),
            (b"", {"parameters_offset": 0, "parameters_bytes": 8}, P.Status.BAD_DESCRIPTOR,
             "outside the caller's arena"),
            (b"", {"parameters_offset": params_at, "parameters_bytes": P.MAX_PARAMETER_BYTES + 1},
             P.Status.INVALID_ARG, "request parameters hold 65537 bytes (limit 65536)"),
            (b"", {"flags": 0x80}, P.Status.BAD_DESCRIPTOR, "request flags 0x80 set unknown bits"),
        ]
        for payload, options, status, words in cases:
            got = send(options, payload)
            assert got is not None, (options, "no answer")
            assert got[0] == status and words in got[1], (payload, options, got)
            assert "model 'params'" in got[1]
        ok = send(at(msgpack.packb({"k": "v"})), msgpack.packb({"k": "v"}))
        assert ok[0] == P.Status.OK, ok
        # Sequence fields are carried; a model without sequence batching ignores them.
        ok = send({"sequence_id": 42, "flags": P.SEQUENCE_START | P.SEQUENCE_END, "priority": 7,
                   "timeout_us": 1})
        assert ok[0] == P.Status.OK, ok
    finally:
        raw.close()
    assert client.infer("params", {"INPUT0": X}, parameters={"still": True})["OUTPUT0"][0, 0] == \
        b'{"still": true}'
