"""Issue 11: ragged batching as Triton's (allow_ragged_batch, batch_input, batch_output;
shmserve/server/ragged.py): requests whose ragged input differs in shape batch
together, the model gets one flat concatenation and the batch inputs, and a
batch_output goes back to each caller in the shape of its own input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import write_model
import shmserve
from shmserve import errors
from shmserve.errors import ConfigError
from shmserve.server.repository import load_model

pytestmark = pytest.mark.timeout(120)

BATCH_INPUTS = [("COUNT", "BATCH_ELEMENT_COUNT"), ("INDEX", "BATCH_ACCUMULATED_ELEMENT_COUNT"),
                ("ZINDEX", "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"),
                ("MAXSHAPE", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE"), ("SHAPE", "BATCH_ITEM_SHAPE"),
                ("FLATSHAPE", "BATCH_ITEM_SHAPE_FLATTEN")]

# numpy-dict API: records what it got; OUTPUT0 = 2x (scattered by input shape), SUM =
# each request's sum (one row per request, cut by the accumulated counts).
RAGGED_CODE = '''
import json, os
import numpy as np

class TritonPythonModel:
    def initialize(self, args):
        self.path = os.path.join(args["model_repository"], "batches.jsonl")

    def execute(self, inputs):
        x = inputs["INPUT0"]
        with open(self.path, "a") as f:
            f.write(json.dumps({k: [list(v.shape), str(v.dtype), v.tolist()]
                                for k, v in inputs.items() if k != "MAXSHAPE"}
                               | {"MAXSHAPE": list(inputs["MAXSHAPE"].shape)}) + "\\n")
        starts = np.concatenate([[0], inputs["INDEX"][:-1]]).astype(np.int64)
        sums = np.add.reduceat(x.reshape(-1), starts).reshape(-1, 1)  # (flat if not ragged)
        return {"OUTPUT0": x * 2, "SUM": sums}
'''


def ragged_config(name: str, ragged: bool = True, extra: str = "") -> str:
    batch_inputs = ",\n".join(
        f'{{ kind: {kind} target_name: "{target}" data_type: '
        f'{"TYPE_INT32" if target != "INDEX" else "TYPE_FP32"} source_input: "INPUT0" }}'
        for target, kind in BATCH_INPUTS)
    return "\n".join([
        f'name: "{name}"', 'backend: "python"', "max_batch_size: 8",
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ]'
        + (" allow_ragged_batch: true" if ragged else "") + " } ]",
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },',
        '         { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] } ]',
        f"batch_input [ {batch_inputs} ]",
        'batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "OUTPUT0" '
        'source_input: "INPUT0" } ]',
        "dynamic_batching { max_queue_delay_microseconds: 200000 }", extra]) + "\n"


def batches(repo, model) -> list[dict]:
    path = repo / model / "batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def three_requests(c, model):
    xs = [np.arange(n, dtype=np.float32).reshape(1, n) + 1 for n in (3, 4, 5)]
    futures = [c.submit(model, [x]) for x in xs]
    return xs, [f.result(30) for f in futures]


def test_ragged_requests_batch_together_with_batch_inputs(server_factory):
    server = server_factory(models=(), setup=lambda repo: write_model(
        repo, "ragged", ragged_config("ragged"), RAGGED_CODE))
    c = server.client(arena_bytes=1 << 20)
    xs, results = three_requests(c, "ragged")
    for x, r in zip(xs, results):
        np.testing.assert_array_equal(r["OUTPUT0"], x * 2)  # the caller's own shape
        np.testing.assert_array_equal(r["SUM"], [[x.sum()]])
    (seen,) = batches(server.repo, "ragged")  # one execution for the three
    assert seen["INPUT0"][:2] == [[12], "float32"]
    assert seen["INPUT0"][2] == np.concatenate([x.reshape(-1) for x in xs]).tolist()
    assert seen["COUNT"] == [[3], "int32", [3, 4, 5]]
    assert seen["INDEX"] == [[3], "float32", [3, 7, 12]]
    assert seen["ZINDEX"] == [[4], "int32", [0, 3, 7, 12]]
    assert seen["MAXSHAPE"] == [5]
    assert seen["SHAPE"] == [[3, 1], "int32", [[3], [4], [5]]]
    assert seen["FLATSHAPE"] == [[3], "int32", [3, 4, 5]]


def test_without_allow_ragged_batch_other_shapes_run_apart(server_factory):
    server = server_factory(models=(), setup=lambda repo: write_model(
        repo, "even", ragged_config("even", ragged=False), RAGGED_CODE))
    c = server.client(arena_bytes=1 << 20)
    xs, results = three_requests(c, "even")
    for x, r in zip(xs, results):
        np.testing.assert_array_equal(r["OUTPUT0"], x * 2)
    assert len(batches(server.repo, "even")) == 3


def write_onnx_ragged(repo):
    """An ONNX model that takes the flat concatenation: OUTPUT = INPUT * 2, and the
    batch input COUNT passed through (not in the config)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT", "TWO"], ["OUTPUT"]),
         helper.make_node("Identity", ["COUNT"], ["COUNT_OUT"])], "ragged",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("COUNT", TensorProto.INT32, ["b"])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("COUNT_OUT", TensorProto.INT32, ["b"])],
        [helper.make_tensor("TWO", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "onnx_ragged" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "onnx_ragged" / "1" / "model.onnx"))
    (repo / "onnx_ragged" / "config.pbtxt").write_text("\n".join([
        'name: "onnx_ragged"', 'backend: "onnxruntime"', "max_batch_size: 8",
        'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]',
        'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]',
        'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_INT32 '
        'source_input: "INPUT" } ]',
        'batch_output [ { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: "OUTPUT" '
        'source_input: "INPUT" } ]',
        "dynamic_batching { max_queue_delay_microseconds: 200000 }"]) + "\n")


def test_onnx_model_takes_the_flat_concatenation(server_factory):
    server = server_factory(models=(), setup=write_onnx_ragged)
    c = server.client(arena_bytes=1 << 20)
    xs = [np.arange(n, dtype=np.float32).reshape(1, n) for n in (2, 6, 3)]
    futures = [c.submit("onnx_ragged", {"INPUT": x}) for x in xs]
    for x, f in zip(xs, futures):
        np.testing.assert_array_equal(f.result(30)["OUTPUT"], x * 2)
    (s,) = c.statistics("onnx_ragged")
    assert s["execution_count"] == 1 and s["inference_count"] == 3


@pytest.mark.parametrize("change, words", [
    (lambda t: t.replace("max_batch_size: 8", "max_batch_size: 0").replace(
        "dynamic_batching { max_queue_delay_microseconds: 200000 }", ""),
     "input 'INPUT0' allow_ragged_batch needs max_batch_size > 0"),
    (lambda t: t.replace('data_type: TYPE_INT32 source_input: "INPUT0" }', 'data_type: TYPE_INT64 '
                         'source_input: "INPUT0" }', 1),
     "batch_input BATCH_ELEMENT_COUNT: data_type must be TYPE_INT32 or TYPE_FP32, not TYPE_INT64"),
    (lambda t: t.replace('target_name: "COUNT" data_type: TYPE_INT32 source_input: "INPUT0"',
                         'target_name: "COUNT" data_type: TYPE_INT32 source_input: "NOPE"'),
     "batch_input BATCH_ELEMENT_COUNT: source_input must name one input of the model"),
    (lambda t: t.replace('target_name: "COUNT"', 'target_name: "INPUT0"'),
     "target_name 'INPUT0' is already an input"),
    (lambda t: t.replace('target_name: "OUTPUT0" source_input', 'target_name: "NOPE" source_input'),
     "batch_output BATCH_SCATTER_WITH_INPUT_SHAPE: target_name must name outputs of the model "
     "('NOPE' is not one)"),
])
def test_config_mistakes_are_named(tmp_path, change, words):
    write_model(tmp_path, "m", change(ragged_config("m")), RAGGED_CODE)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_model(tmp_path / "m")


PER_REQUEST_CODE = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)])
            for r in requests]
'''


def test_per_request_python_models_take_ragged_inputs_but_no_batch_input(server_factory):
    plain = "\n".join([
        'name: "per_request"', 'backend: "python"', "max_batch_size: 8",
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]',
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]',
        "dynamic_batching { max_queue_delay_microseconds: 200000 }"]) + "\n"
    with_inputs = plain.replace('"per_request"', '"with_inputs"') + (
        'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_INT32 '
        'source_input: "INPUT0" } ]\n')

    def setup(repo):
        write_model(repo, "per_request", plain, PER_REQUEST_CODE)
        write_model(repo, "with_inputs", with_inputs, PER_REQUEST_CODE)

    server = server_factory(models=(), setup=setup, args=["--exit-on-error=false"])
    with shmserve.Client(server.name) as c:
        xs = [np.ones((1, n), np.float32) for n in (2, 5)]
        futures = [c.submit("per_request", [x]) for x in xs]
        for x, f in zip(xs, futures):
            np.testing.assert_array_equal(f.result(30)["OUTPUT0"], x * 2)
        (s,) = c.statistics("per_request")
        assert s["execution_count"] == 1  # one batch, each request its own shape
        with pytest.raises(errors.UnavailableError, match="'with_inputs' version 1 is not ready"):
            c.infer("with_inputs", [xs[0]])
        (row,) = [m for m in c.models() if m["name"] == "with_inputs"]
        assert "batch_input and batch_output need a model that takes the whole batch" in \
            json.dumps(row), row
