"""Ensembles (platform "ensemble", server/ensemble.py, backends/ensemble_backend.py):
an ensemble of three models gives what calling them one by one gives, batched and
alone, with intermediate tensors sent in place (counted); a step that fails is named;
every wrong ensemble config is refused by name, and an ensemble whose steps do not
fit its models is UNAVAILABLE with the reason while the others serve."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from helpers import write_model

from shmserve import errors
from shmserve.backends import Instance, load_backend
from shmserve.errors import ConfigError
from shmserve.server.repository import ModelProblem, load_model, scan_repository

pytestmark = pytest.mark.timeout(180)

UNARY = '''
import numpy as np

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["X"]
        if (x < -1000).any():
            raise ValueError("no values below -1000, please")
        return {{"Y": {expr}}}
'''

COMBINE = '''
class TritonPythonModel:
    def execute(self, inputs):
        return {"D": inputs["A"] - inputs["B"]}
'''


def tensor(name, dtype="TYPE_FP32", dims=(4,)):
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] }}'


def unary(repo, name, expr, max_batch_size=8):
    write_model(repo, name, f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
                f'input [ {tensor("X")} ]\noutput [ {tensor("Y")} ]\ndynamic_batching {{ }}\n',
                UNARY.format(expr=expr))


def combine(repo):
    write_model(repo, "combine", 'name: "combine"\nbackend: "python"\nmax_batch_size: 8\n'
                f'input [ {tensor("A")}, {tensor("B")} ]\noutput [ {tensor("D")} ]\n'
                "dynamic_batching { }\n", COMBINE)


# INPUT -> add_one -> t1 -> double -> t2; (t1, t2) -> combine -> OUTPUT; t1 is OUTPUT_T1 too.
DIAMOND_STEPS = '''ensemble_scheduling { step [
  { model_name: "add_one" model_version: -1
    input_map { key: "X" value: "INPUT" } output_map { key: "Y" value: "t1" } },
  { model_name: "double" model_version: 1
    input_map { key: "X" value: "t1" } output_map { key: "Y" value: "t2" } },
  { model_name: "combine" model_version: -1
    input_map { key: "A" value: "t2" } input_map { key: "B" value: "t1" }
    output_map { key: "D" value: "OUTPUT" } } ] }
'''


def ensemble(repo, name="pipeline", steps=DIAMOND_STEPS, max_batch_size=8, extra="",
             outputs=None):
    model = repo / name
    (model / "1").mkdir(parents=True, exist_ok=True)
    outputs = outputs or [tensor("OUTPUT")]
    (model / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {tensor("INPUT")} ]\noutput [ {", ".join(outputs)} ]\n{steps}{extra}\n')
    return model


def pipeline_repo(repo):
    unary(repo, "add_one", "x + 1")
    unary(repo, "double", "x * 2")
    combine(repo)
    ensemble(repo)


def composed(x):
    t1 = x + 1
    return t1 * 2 - t1


# ---------------------------------------------------------------- served

@pytest.fixture
def pipeline(server_factory):
    return server_factory(models=(), setup=pipeline_repo)


def test_an_ensemble_equals_its_models_called_one_by_one(pipeline):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with pipeline.client() as c:
        got = c.infer("pipeline", [x])["OUTPUT"]
        t1 = c.infer("add_one", [x])["Y"]
        by_hand = c.infer("combine", {"A": c.infer("double", [t1])["Y"], "B": t1})["D"]
        np.testing.assert_array_equal(got, by_hand)
        np.testing.assert_array_equal(got, composed(x))
        meta = {m["name"]: m for m in c.models()}["pipeline"]
        assert meta["state"] == "READY" and meta["platform"] == "ensemble"


def test_many_callers_at_once_each_get_their_own_answer(pipeline):
    """Requests of several callers are batched by the ensemble and by each step."""
    def call(i):
        with pipeline.client() as c:
            out = []
            for k in range(20):
                x = np.full((1 + (i + k) % 3, 4), i * 100 + k, np.float32)
                out.append((x, c.infer("pipeline", [x])["OUTPUT"]))
            return out

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for results in pool.map(call, range(6)):
            for x, got in results:
                np.testing.assert_array_equal(got, composed(x))


def test_intermediate_tensors_are_sent_in_place(pipeline):
    """The ensemble's worker logic, run here against the live server: its input is
    copied once into its arena; t1 (to two steps) and t2 are used where they lie."""
    [spec] = [s for s in scan_repository(pipeline.repo)[0] if s.name == "pipeline"]
    backend = load_backend(spec, Instance(server=pipeline.name, socket=str(pipeline.socket_path)))
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(backend.execute({"INPUT": x})["OUTPUT"], composed(x))
        counts = backend.client.engine.counters
        assert (counts["inputs_copied"], counts["inputs_adopted"]) == (1, 3), counts
    finally:
        backend.close()


def test_a_failing_step_is_named_and_the_others_keep_serving(pipeline):
    with pipeline.client() as c:
        with pytest.raises(errors.InternalError) as raised:
            c.infer("pipeline", [np.full((1, 4), -5000, np.float32)])
        assert raised.value.msg.startswith(
            "ensemble 'pipeline' step 0 (model 'add_one'): model 'add_one' raised ValueError: "
            "no values below -1000"), raised.value.msg
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(c.infer("pipeline", [x])["OUTPUT"], composed(x))


def test_an_ensemble_whose_steps_do_not_fit_is_unavailable(server_factory):
    def setup(repo):
        pipeline_repo(repo)
        ensemble(repo, "wrong_version", DIAMOND_STEPS.replace("model_version: 1", "model_version: 7"))

    server = server_factory(models=("identity",), setup=setup, args=["--exit-on-error=false"])
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["pipeline"] == "READY" and states["identity"] == "READY", states
        assert states["wrong_version"] == (
            "UNAVAILABLE: ensemble 'wrong_version': step 1 (model 'double' version 7): no such "
            "model is served (versions served: 1)"), states


# ---------------------------------------------------------------- configs

def refused(tmp_path, message, **kw):
    pipeline_repo(tmp_path)
    model = ensemble(tmp_path, "bad", **kw)
    with pytest.raises(ConfigError, match=message):
        load_model(model)


@pytest.mark.parametrize("steps, message", [
    ("", r'platform "ensemble" needs ensemble_scheduling with at least one step'),
    (DIAMOND_STEPS.replace('value: "INPUT"', 'value: "nowhere"'),
     r"step 0 \(model 'add_one'\) needs ensemble tensor\(s\) nowhere, which neither"),
    (DIAMOND_STEPS.replace('key: "Y" value: "t2"', 'key: "Y" value: "t1"'),
     r"ensemble tensor 't1' is made twice: by step 0 \(model 'add_one'\) and by step 1"),
    (DIAMOND_STEPS.replace('value: "OUTPUT"', 'value: "elsewhere"'),
     r"ensemble output 'OUTPUT' is made by no step"),
    (DIAMOND_STEPS.replace('model_name: "double"', 'model_name: ""'), r"step 1 names no model_name"),
    (DIAMOND_STEPS.replace('value: "INPUT" }', 'value: "t2" }'),
     r"needs ensemble tensor\(s\) t2.*cycle"),
])
def test_a_wrong_graph_is_refused_by_name(tmp_path, steps, message):
    refused(tmp_path, message, steps=steps)


def test_an_ensemble_takes_no_instance_group_nor_dynamic_batching(tmp_path):
    refused(tmp_path, r"an ensemble takes no instance_group .*shmserve.ensemble_instances",
            extra="instance_group [ { count: 2 } ]")
    pipeline_repo(tmp_path / "b")
    model = ensemble(tmp_path / "b", "bad", extra="dynamic_batching { }")
    with pytest.raises(ConfigError, match='config.pbtxt:14:1: Field "dynamic_batching" is '
                       'specified along with field "ensemble_scheduling"'):  # a oneof
        load_model(model)


def test_ensemble_scheduling_belongs_to_ensembles(tmp_path):
    write_model(tmp_path, "py", 'name: "py"\nbackend: "python"\nmax_batch_size: 8\n'
                f'input [ {tensor("X")} ]\noutput [ {tensor("Y")} ]\n' + DIAMOND_STEPS, "")
    with pytest.raises(ConfigError, match='ensemble_scheduling belongs to platform "ensemble"'):
        load_model(tmp_path / "py")


@pytest.mark.parametrize("change, message", [
    (lambda r: unary(r, "double", "x * 2", max_batch_size=4),
     r"max_batch_size 8 exceeds step 1 \(model 'double' version 1\)'s 4"),
    (lambda r: (r / "combine" / "config.pbtxt").write_text(
        (r / "combine" / "config.pbtxt").read_text().replace('name: "B" data_type: TYPE_FP32',
                                                             'name: "B" data_type: TYPE_INT32')),
     r"step 2 \(model 'combine'\) input 'B' is INT32, ensemble tensor 't1' is FP32"),
    (lambda r: (r / "combine" / "config.pbtxt").write_text(
        (r / "combine" / "config.pbtxt").read_text().replace('name: "A"', 'name: "A2"')),
     r"step 2 \(model 'combine'\) input_map names input 'A', which the model does not have"),
    (lambda r: (r / "double" / "config.pbtxt").write_text(
        (r / "double" / "config.pbtxt").read_text().replace("dims: [ 4 ] } ]\ndynamic",
                                                            "dims: [ 5 ] } ]\ndynamic")),
     r"ensemble 'pipeline': step 2 \(model 'combine'\) input 'A' has shape \[-1, 4\], "
     r"ensemble tensor 't2' \[-1, 5\]"),
    (lambda r: __import__("shutil").rmtree(r / "combine"),
     r"step 2 \(model 'combine'\): no such model is served"),
])
def test_steps_are_checked_against_their_models(tmp_path, change, message):
    pipeline_repo(tmp_path)
    change(tmp_path)
    specs, problems = scan_repository(tmp_path)
    assert "pipeline" not in {s.name for s in specs}
    [problem] = [p for p in problems if p.name == "pipeline"]
    assert isinstance(problem, ModelProblem) and problem.version == 1
    assert __import__("re").search(message, problem.reason), problem.reason


def test_validate_lists_an_ensemble_s_step_problem_and_nothing_else(tmp_path):
    from shmserve.server.validate import validate_repository

    pipeline_repo(tmp_path)
    ensemble(tmp_path, "wrong_version", DIAMOND_STEPS.replace("model_version: 1", "model_version: 7"))
    report = validate_repository(tmp_path)
    assert [(f.model, f.severity, f.message) for f in report.findings] == [(
        "wrong_version", "error", "ensemble 'wrong_version': step 1 (model 'double' version 7): "
        "no such model is served (versions served: 1)")]
