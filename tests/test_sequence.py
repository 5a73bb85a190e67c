"""Sequence batching at Triton's semantics (issue 11): accumulators that keep a running
sum per sequence, through implicit state (numpy-dict API) and through their own dict
keyed by CORRID (Triton's python API), with many interleaved sequences from several
processes; every request of a sequence on one instance, in order; the control tensors
as Triton feeds them; direct (slots, null rows) against oldest (batches across
sequences); idle sequences released; the errors Triton gives; string correlation
ids; the HTTP front's sequence parameters.

Determinism: the models record every batch they run (a file per worker process, in
their model directory); nothing here asserts a duration. Where a test must see a
batch form, the scheduler waits for it (a long max_queue_delay with a preferred size or
minimum_slot_utilization 1.0), so the batch is the same on any machine."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from helpers import IDENTITY_CODE, python_config, wait_until, write_model
from test_cpp_client import _run, cpp_build  # noqa: F401 (cpp_build: the session's C++ build)
from shmserve import errors
from shmserve.errors import ConfigError
from shmserve.server.repository import load_model

pytestmark = pytest.mark.timeout(180)

CONTROLS_INT = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [0, 1] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [0, 1] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: %s } ] }
  ]"""
STATE = """
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT64 dims: [1]
            initial_state { name: "zero" data_type: TYPE_INT64 dims: [1] zero_data: true } } ]"""

# numpy-dict API, implicit state: OUTPUT0 = STATE_IN + INPUT0 on ready rows; records per
# batch its rows [corrid, start, end, ready, input, state_in].
STATE_ACC_CODE = '''
import json, os
import numpy as np

class TritonPythonModel:
    def initialize(self, args):
        self.path = os.path.join(args["model_repository"], f"rec-{os.getpid()}.jsonl")

    def execute(self, inputs):
        x, s, ready = inputs["INPUT0"], inputs["STATE_IN"], inputs["READY"]
        out = s + x * ready
        cid = inputs["CORRID"]
        rows = [[c.decode() if isinstance(c, bytes) else int(c), int(a), int(b), int(r), int(v), int(si)]
                for c, a, b, r, v, si in zip(cid[:, 0], inputs["START"][:, 0], inputs["END"][:, 0],
                                             ready[:, 0], x[:, 0], s[:, 0])]
        with open(self.path, "a") as f:
            f.write(json.dumps(rows) + "\\n")
        return {"OUTPUT0": out, "STATE_OUT": out}
'''

# Triton's python API, its own dict keyed by CORRID; START/END bool, READY fp32.
DICT_ACC_CODE = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.path = os.path.join(args["model_repository"], f"rec-{os.getpid()}.jsonl")
        self.sums = {}

    def execute(self, requests):
        rows, responses = [], []
        for r in requests:
            get = lambda n: pb_utils.get_input_tensor_by_name(r, n).as_numpy()
            c, start, end, ready = int(get("CORRID")[0, 0]), get("START"), get("END"), get("READY")
            x = int(get("INPUT0")[0, 0])
            if start[0, 0]:
                self.sums[c] = 0
            self.sums[c] += x
            rows.append([c, bool(start[0, 0]), bool(end[0, 0]), float(ready[0, 0]), x,
                         str(start.dtype), str(ready.dtype)])
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", np.array([[self.sums[c]]], np.int64))]))
            if end[0, 0]:
                del self.sums[c]
        with open(self.path, "a") as f:
            f.write(json.dumps(rows) + "\\n")
        return responses
'''

CONTROLS_MIXED = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [false, true] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [false, true] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [0, 1] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]"""


def seq_config(name: str, batching: str, *, max_batch_size=4, count=1, corrid="TYPE_UINT64",
               state=True, controls=None) -> str:
    body = batching + (controls or CONTROLS_INT % corrid) + (STATE if state else "")
    return "\n".join([
        f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
        'input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [1] } ]',
        'output [ { name: "OUTPUT0" data_type: TYPE_INT64 dims: [1] } ]',
        f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]",
        f"sequence_batching {{ {body} }}"]) + "\n"


def records(model_dir: Path) -> dict[str, list]:
    """Per worker file: its batches, in the order it ran them."""
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted(model_dir.glob("rec-*.jsonl"))}


def x(v: int) -> dict:
    return {"INPUT0": np.array([[v]], np.int64)}


def value(corrid: int, step: int) -> int:
    return 100 * step + corrid % 50 + 1  # grows with the step: the order is visible


def run_sequences(socket_path: str, name: str, model: str, corrids: list, steps: int) -> str:
    """One caller process: its sequences interleaved step by step, every request
    submitted before any answer is read; returns "" or what went wrong."""
    import shmserve
    with shmserve.Client(name, socket_path_=socket_path) as c:
        futures = []
        for step in range(steps):
            for cid in corrids:
                futures.append((cid, step, c.submit(model, x(value(cid, step)), sequence_id=cid,
                                                    sequence_start=step == 0,
                                                    sequence_end=step == steps - 1)))
        for cid, step, f in futures:
            got = int(f.result(timeout=120)["OUTPUT0"][0, 0])
            want = sum(value(cid, k) for k in range(step + 1))
            if got != want:
                return f"sequence {cid} step {step}: got {got}, want {want}"
    return ""


def check_routing(model_dir: Path, corrids: list, steps: int) -> None:
    """Every sequence ran on one worker, its steps in order, each once."""
    seen: dict[int, tuple[str, list]] = {}
    for worker, batches in records(model_dir).items():
        for batch in batches:
            cids = [row[0] for row in batch if row[3]]
            assert len(cids) == len(set(cids)), f"a batch holds a sequence twice: {batch}"
            for row in batch:
                if not row[3]:
                    continue
                w, inputs = seen.setdefault(row[0], (worker, []))
                assert w == worker, f"sequence {row[0]} ran on {w} and {worker}"
                inputs.append(row[4])
    assert sorted(seen) == sorted(corrids)
    for cid, (_, inputs) in seen.items():
        assert inputs == [value(cid, k) for k in range(steps)], (cid, inputs)


@pytest.mark.parametrize("model", ["acc_state", "acc_dict"])
def test_many_interleaved_sequences_from_several_processes(server_factory, model):
    """56 sequences from 4 processes, 6 steps each, on 2 instances: implicit state
    (direct, 32 slots an instance) and the model's own dict (oldest, 32 candidates an
    instance). The slots hold every sequence at once: a caller that keeps more
    sequences open than there are slots, with a bounded window of requests in flight,
    can wait for ever on a backlogged START (as with Triton); the backlog has its own
    test below."""
    def setup(repo):
        idle = "max_sequence_idle_microseconds: 60000000 "
        write_model(repo, "acc_state", seq_config("acc_state", idle + "direct { }", count=2,
                                                  max_batch_size=32), STATE_ACC_CODE)
        write_model(repo, "acc_dict", seq_config(
            "acc_dict", idle + "oldest { max_candidate_sequences: 32 }", count=2, state=False,
            controls=CONTROLS_MIXED), DICT_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    corrids = [1000 + i for i in range(56)]
    groups = [corrids[i::4] for i in range(4)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        outcomes = pool.starmap_async(run_sequences, [(str(server.socket_path), server.name, model,
                                                       g, 6) for g in groups]).get(timeout=170)
    assert outcomes == [""] * 4, [o for o in outcomes if o]
    check_routing(server.repo / model, corrids, 6)
    workers = records(server.repo / model)
    assert len(workers) == 2, "both instances took sequences"
    if model == "acc_dict":  # the controls in their configured types
        rows = [row for batches in workers.values() for batch in batches for row in batch]
        assert {(r[5], r[6]) for r in rows} == {("bool", "float32")}
        assert all(r[3] == 1.0 for r in rows)
        assert sum(r[1] for r in rows) == 56 and sum(r[2] for r in rows) == 56


def test_direct_slots_null_rows_and_control_tensors(server_factory):
    """Direct: a sequence keeps its batch slot; a slot without a request is a null row
    (READY 0, START/END 0, CORRID 0, input 0), the state of each slot its own."""
    def setup(repo):
        write_model(repo, "direct", seq_config("direct", "direct { }"), STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    assert int(c.infer("direct", x(5), sequence_id=11, sequence_start=True)["OUTPUT0"][0, 0]) == 5
    assert int(c.infer("direct", x(7), sequence_id=12, sequence_start=True)["OUTPUT0"][0, 0]) == 7
    assert int(c.infer("direct", x(1), sequence_id=12)["OUTPUT0"][0, 0]) == 8
    assert int(c.infer("direct", x(2), sequence_id=11, sequence_end=True)["OUTPUT0"][0, 0]) == 7
    # slot 0 is free again: a new sequence takes it and starts from the initial state
    assert int(c.infer("direct", x(3), sequence_id=13, sequence_start=True)["OUTPUT0"][0, 0]) == 3
    (batches,) = records(server.repo / "direct").values()
    assert batches == [
        [[11, 1, 0, 1, 5, 0]],
        [[0, 0, 0, 0, 0, 0], [12, 1, 0, 1, 7, 0]],
        [[0, 0, 0, 0, 0, 0], [12, 0, 0, 1, 1, 7]],
        [[11, 0, 1, 1, 2, 5]],
        [[13, 1, 0, 1, 3, 0]],
    ]


def test_direct_and_oldest_form_batches_across_sequences(server_factory):
    """Both wait for a full batch here (direct: minimum_slot_utilization 1.0; oldest: a
    preferred size of 4), and take one request of each of 4 sequences. Then direct keeps
    slot positions (null rows before the one slot with a request), oldest does not."""
    def setup(repo):
        write_model(repo, "direct", seq_config(
            "direct", "direct { minimum_slot_utilization: 1.0 max_queue_delay_microseconds: "
            "60000000 }"), STATE_ACC_CODE)
        write_model(repo, "oldest", seq_config(
            "oldest", "oldest { max_candidate_sequences: 4 preferred_batch_size: [4] "
            "max_queue_delay_microseconds: 60000000 }"), STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    for model in ("direct", "oldest"):
        starts = [c.submit(model, x(i + 1), sequence_id=i + 1, sequence_start=True) for i in range(4)]
        assert [int(f.result(timeout=60)["OUTPUT0"][0, 0]) for f in starts] == [1, 2, 3, 4]
        (batches,) = records(server.repo / model).values()
        assert batches == [[[i + 1, 1, 0, 1, i + 1, 0] for i in range(4)]], (model, batches)
    # the four END requests: again one batch each (direct: every slot; oldest: size 4)
    fs = [c.submit("direct", x(10), sequence_id=i + 1, sequence_end=True) for i in range(4)]
    assert [int(f.result(timeout=60)["OUTPUT0"][0, 0]) for f in fs] == [11, 12, 13, 14]
    fs = [c.submit("oldest", x(10), sequence_id=i + 1, sequence_end=True) for i in range(4)]
    assert [int(f.result(timeout=60)["OUTPUT0"][0, 0]) for f in fs] == [11, 12, 13, 14]
    for model in ("direct", "oldest"):
        (batches,) = records(server.repo / model).values()
        assert batches[1] == [[i + 1, 0, 1, 1, 10, i + 1] for i in range(4)], (model, batches)


def test_oldest_takes_no_null_rows_and_direct_does(server_factory):
    """Three sequences hold slots 0..2; only the third sends: direct runs 3 rows (two
    null), oldest one."""
    def setup(repo):
        write_model(repo, "direct", seq_config("direct", "direct { }"), STATE_ACC_CODE)
        write_model(repo, "oldest", seq_config("oldest", "oldest { max_candidate_sequences: 4 }"),
                    STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    for model in ("direct", "oldest"):
        for cid in (1, 2, 3):
            c.infer(model, x(cid), sequence_id=cid, sequence_start=True)
        assert int(c.infer(model, x(4), sequence_id=3)["OUTPUT0"][0, 0]) == 7
    (direct,) = records(server.repo / "direct").values()
    (oldest,) = records(server.repo / "oldest").values()
    assert [[row[0] for row in b] for b in direct][-1] == [0, 0, 3]
    assert oldest[-1] == [[3, 0, 0, 1, 4, 3]]


def test_string_correlation_ids(server_factory):
    """TYPE_STRING CORRID: string ids reach the model as they were sent; a numeric id to
    it is refused, and a string id to a numeric CORRID too."""
    def setup(repo):
        write_model(repo, "strseq", seq_config("strseq", "direct { }", corrid="TYPE_STRING"),
                    STATE_ACC_CODE)
        write_model(repo, "numseq", seq_config("numseq", "direct { }"), STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    sid = "3f2c9a1e-7d4b-4e8a-9c01-5b6d7e8f9a0b"
    assert int(c.infer("strseq", x(4), sequence_id=sid, sequence_start=True)["OUTPUT0"][0, 0]) == 4
    assert int(c.submit("strseq", x(5), sequence_id="é-2", sequence_start=True)
               .result(timeout=30)["OUTPUT0"][0, 0]) == 5
    assert int(c.infer("strseq", x(6), sequence_id=sid, sequence_end=True)["OUTPUT0"][0, 0]) == 10
    (batches,) = records(server.repo / "strseq").values()
    assert [row[0] for b in batches for row in b if row[3]] == [sid, "é-2", sid]
    with pytest.raises(errors.InvalidArgumentError, match="takes a string correlation ID"):
        c.infer("strseq", x(1), sequence_id=7, sequence_start=True)
    with pytest.raises(errors.InvalidArgumentError, match="takes a unsigned integer correlation ID"):
        c.infer("numseq", x(1), sequence_id="a", sequence_start=True)
    with pytest.raises(errors.InvalidArgumentError, match="sequence_id takes 300 bytes"):
        c.infer("strseq", x(1), sequence_id="a" * 300, sequence_start=True)


def test_errors_as_triton_gives_them(server_factory):
    def setup(repo):
        write_model(repo, "seq", seq_config("seq", "direct { }"), STATE_ACC_CODE)
        write_model(repo, "plain", python_config("plain", "INT64", (1,)), IDENTITY_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.infer("seq", x(1), sequence_id=5)
    assert str(e.value) == ("inference request for sequence 5 to model 'seq' must specify the "
                            "START flag on the first request of the sequence")
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.infer("seq", x(1))
    assert str(e.value) == ("inference request to model 'seq' must specify a non-zero or "
                            "non-empty correlation ID")
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.infer("seq", {"INPUT0": np.ones((2, 1), np.int64)}, sequence_id=5, sequence_start=True)
    assert "must specify batch-size 1 due to requirements of sequence batcher" in str(e.value)
    for kw in ({"sequence_id": 5}, {"sequence_start": True}, {"sequence_id": "s"}):
        with pytest.raises(errors.InvalidArgumentError) as e:
            c.infer("plain", x(1), **kw)
        assert "model 'plain' has no sequence_batching" in str(e.value)
    # after its END a sequence is gone: its id needs a START again
    c.infer("seq", x(1), sequence_id=6, sequence_start=True, sequence_end=True)
    with pytest.raises(errors.InvalidArgumentError, match="must specify the START flag"):
        c.infer("seq", x(1), sequence_id=6)
    assert c.infer("plain", x(3))["OUTPUT0"].tolist() == [[3]]  # the server serves on


def test_backlog_waits_for_a_slot(server_factory):
    """One slot (max_batch_size 1, one instance): a second sequence's START waits in
    the backlog until the first ENDs, then runs from the initial state."""
    def setup(repo):
        write_model(repo, "one", seq_config(
            "one", "max_sequence_idle_microseconds: 60000000 direct { }", max_batch_size=1),
            STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    assert int(c.infer("one", x(2), sequence_id=1, sequence_start=True)["OUTPUT0"][0, 0]) == 2
    waiting = [c.submit("one", x(3), sequence_id=2, sequence_start=True),
               c.submit("one", x(4), sequence_id=2, sequence_end=True)]
    wait_until(lambda: c.statistics("one")[0]["shmserve"]["pending"] == 2, 30,
               "the second sequence in the backlog")
    assert not any(f.done() for f in waiting)
    assert int(c.infer("one", x(5), sequence_id=1, sequence_end=True)["OUTPUT0"][0, 0]) == 7
    assert [int(f.result(timeout=60)["OUTPUT0"][0, 0]) for f in waiting] == [3, 7]
    (batches,) = records(server.repo / "one").values()
    assert [b[0][0] for b in batches] == [1, 1, 2, 2]


def test_idle_sequences_are_released(server_factory):
    """One slot (max_batch_size 1): a second sequence waits in the backlog until the
    first, idle for max_sequence_idle_microseconds, is released; the released sequence's
    next request without START is refused."""
    def setup(repo):
        write_model(repo, "idle", seq_config(
            "idle", "max_sequence_idle_microseconds: 200000 direct { }", max_batch_size=1),
            STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    c = server.client()
    assert int(c.infer("idle", x(2), sequence_id=1, sequence_start=True)["OUTPUT0"][0, 0]) == 2
    waiting = c.submit("idle", x(3), sequence_id=2, sequence_start=True)
    assert int(waiting.result(timeout=60)["OUTPUT0"][0, 0]) == 3  # it got the released slot
    with pytest.raises(errors.InvalidArgumentError, match="sequence 1 .* must specify the START"):
        c.infer("idle", x(1), sequence_id=1)
    wait_until(lambda: c.submit("idle", x(1), sequence_id=3, sequence_start=True)
               .result(timeout=30) is not None, 30, "a new sequence after the release")


def test_config_errors_name_the_field(tmp_path):
    cases = [
        ("direct { }" + CONTROLS_INT % "TYPE_FP32", "CONTROL_SEQUENCE_CORRID data_type"),
        ("direct { } control_input [ { name: \"INPUT0\" control [ { kind: "
         "CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] } ]", "control_input 'INPUT0'"),
        ("direct { } control_input [ { name: \"S\" control [ { kind: "
         "CONTROL_SEQUENCE_START int32_false_true: [0] } ] } ]", "of two values"),
        ("oldest { preferred_batch_size: [9] }", "preferred_batch_size"),
        ("direct { } state [ { input_name: \"A\" output_name: \"B\" data_type: TYPE_FP32 "
         "dims: [-1] } ]", "must be fixed"),
    ]
    for i, (body, words) in enumerate(cases):
        cfg = "\n".join([f'name: "m{i}"', 'backend: "python"', "max_batch_size: 4",
                         'input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [1] } ]',
                         'output [ { name: "OUTPUT0" data_type: TYPE_INT64 dims: [1] } ]',
                         f"sequence_batching {{ {body} }}"])
        model_dir = write_model(tmp_path, f"m{i}", cfg, IDENTITY_CODE)
        with pytest.raises(ConfigError, match="sequence_batching") as e:
            load_model(model_dir)
        assert words in str(e.value), (words, str(e.value))
    both = python_config("both", extra="sequence_batching { }")
    with pytest.raises(ConfigError, match='"sequence_batching" is specified along with field "dynamic_batching"'):
        load_model(write_model(tmp_path, "both", both, IDENTITY_CODE))


def test_http_front_sequence_parameters(server_factory):
    th = pytest.importorskip("tritonclient.http")
    from test_metrics import free_port
    port = free_port()

    def setup(repo):
        write_model(repo, "seq", seq_config("seq", "direct { }"), STATE_ACC_CODE)

    server_factory(models=(), setup=setup, args=["--http-port", str(port)])
    wait_until(lambda: _live(port), 60, "the HTTP front listening")
    client = th.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        def call(v, **kw):
            inp = th.InferInput("INPUT0", [1, 1], "INT64")
            inp.set_data_from_numpy(np.array([[v]], np.int64))
            return int(client.infer("seq", [inp], **kw).as_numpy("OUTPUT0")[0, 0])

        assert call(4, sequence_id=77, sequence_start=True) == 4
        assert call(5, sequence_id=77) == 9
        assert call(6, sequence_id=77, sequence_end=True) == 15
        with pytest.raises(th.InferenceServerException, match="must specify the START flag"):
            call(1, sequence_id=77)
    finally:
        client.close()


def _live(port: int) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# BLS: a Triton-API model that forwards its request to "acc" as a sequence request,
# its correlation id and flags from parameters.
BLS_CODE = '''
import json
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            p = json.loads(r.parameters())
            flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if p.get("start") else 0) | \\
                    (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if p.get("end") else 0)
            reply = pb_utils.InferenceRequest(
                model_name="acc", inputs=[pb_utils.get_input_tensor_by_name(r, "INPUT0")],
                requested_output_names=["OUTPUT0"], correlation_id=p["id"], flags=flags).exec()
            if reply.has_error():
                raise pb_utils.TritonModelException(reply.error().message())
            out.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(reply, "OUTPUT0")]))
        return out
'''


def test_bls_requests_carry_correlation_id_and_flags(server_factory):
    def setup(repo):
        write_model(repo, "acc", seq_config("acc", "direct { }"), STATE_ACC_CODE)
        write_model(repo, "caller", python_config("caller", "INT64", (1,)), BLS_CODE)

    c = server_factory(models=(), setup=setup).client()
    sums = [int(c.infer("caller", x(v), parameters={"id": 9, "start": i == 0, "end": i == 2})
                ["OUTPUT0"][0, 0]) for i, v in enumerate((2, 3, 4))]
    assert sums == [2, 5, 9]
    with pytest.raises(errors.InternalError, match="must specify the START flag"):
        c.infer("caller", x(1), parameters={"id": 9})


def test_hostile_string_ids_are_answered(server_factory):
    """The string correlation id fields as a hostile client writes them: each request
    answered with its error, the server serving on."""
    from helpers import RawLease
    from shmserve import protocol as P
    from shmserve.protocol import LAYOUT as L

    def setup(repo):
        write_model(repo, "strseq", seq_config("strseq", "direct { }", corrid="TYPE_STRING"),
                    STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    raw = RawLease(server.socket_path)
    try:
        data = raw.data_offset
        raw.buf[data:data + 8] = np.array([[1]], np.int64).tobytes()
        inputs = [(0, P.DataType.INT64, 2, data, 8, (1, 1))]
        outputs = [(0, 0, 0, data + 4096, 4096, ())]
        sid_at = data + 8192
        raw.buf[sid_at:sid_at + 4] = b"\xff\xfeab"

        def send(options: dict):
            gen = raw.write_raw_request(0, raw.model_ids["strseq"], 1, 1, inputs, outputs)
            req = raw.slot_offset(0) + L["slot.request"]
            for field, v in {"flags": P.SEQUENCE_START, **options}.items():
                raw._put(req, "request", field, v)
            assert raw.push(0, gen) == P.RingResult.OK
            return raw.wait_done(0)

        for options, status, words in [
            ({"sequence_id_offset": sid_at, "sequence_id_bytes": 257}, P.Status.INVALID_ARG,
             "string correlation id holds 257 bytes (limit 256)"),
            ({"sequence_id_offset": sid_at, "sequence_id_bytes": 2, "sequence_id": 5},
             P.Status.INVALID_ARG, "both a numeric and a string correlation id"),
            ({"sequence_id_offset": raw.arena_bytes - 1, "sequence_id_bytes": 4},
             P.Status.BAD_DESCRIPTOR, "string correlation id ["),
            ({"sequence_id_offset": 0, "sequence_id_bytes": 4}, P.Status.BAD_DESCRIPTOR,
             "outside the caller's arena"),
            ({"sequence_id_offset": sid_at, "sequence_id_bytes": 4}, P.Status.INVALID_ARG,
             "the string correlation id is not UTF-8"),
            ({"sequence_id": 0}, P.Status.INVALID_ARG, "non-empty correlation ID"),
        ]:
            got = send(options)
            assert got is not None and got[0] == status and words in got[1], (options, got)
            assert "model 'strseq'" in got[1]
        ok = send({"sequence_id_offset": sid_at + 2, "sequence_id_bytes": 2})
        assert ok[0] == P.Status.OK, ok
    finally:
        raw.close()
    (batches,) = records(server.repo / "strseq").values()
    assert batches == [[["ab", 1, 0, 1, 1, 0]]]


@pytest.mark.timeout(420)  # the C++ build, when this is the session's first user of it
def test_cpp_client_sequences(server_factory, cpp_build):  # noqa: F811
    """The C++ client's sequence_id / sequence_id_str / sequence_start / sequence_end
    (clients/cpp/tests/test_client.cpp, mode "sequence")."""

    def setup(repo):
        write_model(repo, "acc", seq_config("acc", "direct { }"), STATE_ACC_CODE)
        write_model(repo, "strseq", seq_config("strseq", "direct { }", corrid="TYPE_STRING"),
                    STATE_ACC_CODE)

    server = server_factory(models=(), setup=setup)
    r = _run([cpp_build / "shmserve_cpp_tests", "sequence", "--socket", server.socket_path])
    assert "sequence: 0 failures" in r.stdout, r.stdout
    rows = [row for batches in records(server.repo / "strseq").values() for b in batches for row in b]
    assert {row[0] for row in rows if row[3]} == {"cpp-sequence-é"}


# -- the scheduler alone (no server) ---------------------------------------------------

def seq_spec(strategy: str = "direct", max_batch_size: int = 2, instances: int = 2, **seq):
    from shmserve.server.repository import ModelSpec, TensorSpec
    t = TensorSpec("INPUT0", 9, (1,))
    sequence = {"strategy": strategy, "idle_us": 1000, "delay_us": 0, "min_slot_utilization": 0.0,
                "max_candidates": max_batch_size, "preferred": [], "controls": [],
                "corrid": None, "states": [], **seq}
    return ModelSpec(name="s", version=1, backend="python", path="/x", max_batch_size=max_batch_size,
                     inputs=(t,), outputs=(t,), instance_count=instances, dynamic_batching=False,
                     preferred_batch_sizes=(), max_queue_delay_us=0, parameters={}, config_text="",
                     sequence=sequence)


def sp(i: int, corrid, start=False, end=False, at_us=0):
    from shmserve import protocol as P
    from shmserve.server.scheduling import SequencePending
    flags = (P.SEQUENCE_START if start else 0) | (P.SEQUENCE_END if end else 0)
    return SequencePending(i, 1, b"k", at_us * 1000, None, 0, corrid=corrid, flags=flags)


def test_scheduler_slots_backlog_and_release():
    from shmserve.server.scheduling import make_scheduler
    q = make_scheduler(seq_spec())  # 2 instances x 2 slots
    for i, cid in enumerate((1, 2, 3, 4, 5)):
        assert q.enqueue(sp(i, cid, start=True)) is None
    # spread over the instances (most free slots first), the fifth in the backlog
    assert {cid: (s.instance, s.slot) for cid, s in q.live.items()} == \
        {1: (0, 0), 2: (1, 0), 3: (0, 1), 4: (1, 1)}
    assert list(q.backlog) == [5] and len(q) == 5
    plan, _ = q.assign(0, [0, 1])
    assert [(i, [p.corrid for p in b]) for i, b in plan] == [(0, [1, 3]), (1, [2, 4])]
    assert [p.sequence_slot for _, b in plan for p in b] == [0, 1, 0, 1]
    q.enqueue(sp(9, 2, end=True, at_us=1))
    plan, _ = q.assign(2000, [1])  # 2's END frees its slot: 5 takes it
    assert [p.corrid for _, b in plan for p in b] == [2]
    assert (q.live[5].instance, q.live[5].slot) == (1, 0) and not q.backlog
    # idle: 1, 3 and 4 have had no request for 1 ms; 5 (started at 2 ms) has one queued
    rejected, next_release = q.expire(2_000_000)
    assert rejected == [] and sorted(q.live) == [5] and next_release is None
    refused = q.enqueue(sp(10, 1, at_us=2001))
    assert refused is not None and "must specify the START flag" in refused.message


def test_scheduler_direct_waits_for_utilization_and_oldest_cuts_to_preferred():
    from shmserve.server.scheduling import make_scheduler
    q = make_scheduler(seq_spec(max_batch_size=4, instances=1, min_slot_utilization=1.0,
                                delay_us=100))
    for i in range(3):
        q.enqueue(sp(i, i + 1, start=True, at_us=i))
    assert q.assign(10_000, [0]) == ([], 100_000)  # 3 of 4 slots: waits for the delay
    plan, _ = q.assign(100_000, [0])
    assert [p.corrid for _, b in plan for p in b] == [1, 2, 3]
    q = make_scheduler(seq_spec("oldest", max_batch_size=4, instances=1, max_candidates=8,
                                preferred=[2], delay_us=100))
    for i in range(3):
        q.enqueue(sp(i, i + 1, start=True, at_us=10 - i))  # the newest sequence id is the oldest
    plan, _ = q.assign(0, [0])
    assert [p.corrid for _, b in plan for p in b] == [3, 2]  # oldest first, cut to 2
    q.enqueue(sp(5, 3, at_us=20))
    plan, deadline = q.assign(20_000, [0])  # 1's START and 3's next: 2 = preferred
    assert [p.corrid for _, b in plan for p in b] == [1, 3]


STATE_API_CODE = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            get = lambda n: pb_utils.get_input_tensor_by_name(r, n).as_numpy()
            s = get("STATE_IN") + get("INPUT0")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", s),
                                                   pb_utils.Tensor("STATE_OUT", s)]))
        return out
'''


def test_triton_api_state_and_initial_state_from_a_data_file(server_factory):
    """Implicit state through Triton's python API (state in, state out in the
    response), its initial state read from initial_state's data_file."""
    state = STATE.replace('zero_data: true', 'data_file: "hundred"')

    def setup(repo):
        model_dir = write_model(repo, "api", seq_config("api", "oldest { }", state=False,
                                                        controls=state), STATE_API_CODE)
        (model_dir / "initial_state").mkdir()
        (model_dir / "initial_state" / "hundred").write_bytes(np.array([100], np.int64).tobytes())

    c = server_factory(models=(), setup=setup).client()
    assert [int(c.infer("api", x(v), sequence_id=3, sequence_start=k == 0)["OUTPUT0"][0, 0])
            for k, v in enumerate((1, 2, 3))] == [101, 103, 106]
    assert int(c.infer("api", x(1), sequence_id=3, sequence_start=True)["OUTPUT0"][0, 0]) == 101


def test_scheduler_request_queued_after_an_end_without_start_is_refused():
    from shmserve.server.scheduling import make_scheduler
    q = make_scheduler(seq_spec(instances=1))
    assert q.enqueue(sp(0, 7, start=True, end=True)) is None
    assert q.enqueue(sp(1, 7)) is None  # queued behind: the sequence is live now
    assert q.enqueue(sp(2, 7, start=True)) is None  # the id's next sequence
    plan, deadline = q.assign(5, [0])
    assert [p.shadow for _, b in plan for p in b] == [0] and deadline == 5
    rejected, _ = q.expire(5)
    assert [(r.pending.shadow, "must specify the START flag" in r.message) for r in rejected] == \
        [(1, True)]
    assert len(q) == 1 and [p.shadow for _, b in q.assign(6, [0])[0] for p in b] == [2]


def test_grpc_front_sequence_parameters(server_factory):
    """tritonclient.grpc's sequence_id / sequence_start / sequence_end, numeric and string
    ids, through the gRPC front (request parameters mapped as the HTTP front maps them)."""
    tg = pytest.importorskip("tritonclient.grpc")
    from test_grpc_front import start_grpc

    def setup(repo):
        write_model(repo, "seq", seq_config("seq", "direct { }"), STATE_ACC_CODE)
        write_model(repo, "strseq", seq_config("strseq", "direct { }", corrid="TYPE_STRING"),
                    STATE_ACC_CODE)

    _, client, _ = start_grpc(server_factory, models=(), setup=setup)
    try:
        def call(model, v, **kw):
            inp = tg.InferInput("INPUT0", [1, 1], "INT64")
            inp.set_data_from_numpy(np.array([[v]], np.int64))
            return int(client.infer(model, [inp], **kw).as_numpy("OUTPUT0")[0, 0])

        assert call("seq", 4, sequence_id=77, sequence_start=True) == 4
        assert call("strseq", 1, sequence_id="g-1", sequence_start=True) == 1
        assert call("seq", 5, sequence_id=77, sequence_end=True) == 9
        assert call("strseq", 2, sequence_id="g-1", sequence_end=True) == 3
        with pytest.raises(tg.InferenceServerException, match="must specify the START flag"):
            call("seq", 1, sequence_id=77)
    finally:
        client.close()


def test_fields_without_effect_are_warned_about_by_name(tmp_path, caplog):
    """oldest preserve_ordering and a state's buffer options change no result: the model
    loads, with a warning naming each."""
    import logging

    from tritonclient.grpc import model_config_pb2 as mc
    from google.protobuf import text_format

    from shmserve.server import sequence_config

    cfg = text_format.Parse(
        'name: "s" max_batch_size: 4 sequence_batching { oldest { preserve_ordering: true } '
        'state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 1 ] '
        'use_same_buffer_for_input_output: true use_growable_memory: true } ] }', mc.ModelConfig())
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        assert sequence_config.parse(cfg, tmp_path, "m")["strategy"] == "oldest"
    for what in ("oldest preserve_ordering", "state 'SI' use_same_buffer_for_input_output",
                 "state 'SI' use_growable_memory"):
        assert f"{what} is not implemented by shmserve yet and is ignored" in caplog.text


def _onnx_accumulator(path: Path) -> None:
    """OUTPUT0 = STATE_OUT = STATE_IN + INPUT0, int64 [-1, 1]."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    io = lambda n: helper.make_tensor_value_info(n, TensorProto.INT64, ["b", 1])  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Add", ["STATE_IN", "INPUT0"], ["OUTPUT0"]),
         helper.make_node("Identity", ["OUTPUT0"], ["STATE_OUT"])],
        "acc", [io("INPUT0"), io("STATE_IN")], [io("OUTPUT0"), io("STATE_OUT")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _torch_accumulator(path: Path) -> None:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (pip install 'shmserve[torch]', torch==2.13.0)")

    class Acc(torch.nn.Module):
        def forward(self, INPUT0, STATE_IN):  # noqa: N803 (named as the config's inputs)
            s = STATE_IN + INPUT0
            return s, s

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Acc()).save(str(path))


@pytest.mark.parametrize("platform", ["onnxruntime_onnx", "pytorch_libtorch"])
def test_framework_models_keep_implicit_state(server_factory, platform):
    """Implicit state is not a python-model feature: an ONNX graph and a TorchScript
    module that read STATE_IN and write STATE_OUT keep a running sum per sequence,
    interleaved sequences batched together (oldest), each from the initial state."""
    outputs = "OUTPUT0" if platform == "onnxruntime_onnx" else "OUTPUT__0"

    def setup(repo):
        model_dir = repo / "acc"
        (model_dir / "1").mkdir(parents=True)
        if platform == "onnxruntime_onnx":
            _onnx_accumulator(model_dir / "1" / "model.onnx")
        else:
            _torch_accumulator(model_dir / "1" / "model.pt")
        state = STATE.replace("STATE_OUT", "OUTPUT__1" if platform != "onnxruntime_onnx"
                              else "STATE_OUT")
        (model_dir / "config.pbtxt").write_text("\n".join([
            'name: "acc"', f'platform: "{platform}"', "max_batch_size: 4",
            'input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [1] } ]',
            f'output [ {{ name: "{outputs}" data_type: TYPE_INT64 dims: [1] }} ]',
            "sequence_batching { oldest { max_candidate_sequences: 8 "
            "max_queue_delay_microseconds: 20000 preferred_batch_size: [ 3 ] }" + state + " }"]))

    c = server_factory(models=(), setup=setup).client()
    ids = (11, 12, 13)
    sums = dict.fromkeys(ids, 0)
    for step in range(4):
        futures = {cid: c.submit("acc", x(value(cid, step)), sequence_id=cid,
                                 sequence_start=step == 0, sequence_end=step == 3)
                   for cid in ids}
        for cid, f in futures.items():
            sums[cid] += value(cid, step)
            assert int(f.result(timeout=60)[outputs][0, 0]) == sums[cid], (platform, cid, step)
    # a new sequence on a used id starts from the initial state again
    assert int(c.infer("acc", x(5), sequence_id=11, sequence_start=True,
                       sequence_end=True)[outputs][0, 0]) == 5
