"""The repository read as Triton reads it: platform and backend names, version
directories and version_policy, model_warmup, label_filename, optional inputs and
reshape. Parsing is checked on load_model / scan_repository; what happens at load
and per request on one server of this module's models."""
from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
from helpers import IDENTITY_CODE, module_server, python_config, write_model

from shmserve import errors
from shmserve.errors import ConfigError
from shmserve.server import reshape
from shmserve.server.repository import TensorSpec, load_model, scan_repository

pytestmark = pytest.mark.timeout(180)


def tensor(name, dims, dtype="TYPE_FP32", extra=""):
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ] {extra} }}'


def config(name, inputs, outputs, max_batch_size=8, extra="", backend='backend: "python"'):
    return (f'name: "{name}"\n{backend}\nmax_batch_size: {max_batch_size}\n'
            f'input [ {", ".join(inputs)} ]\noutput [ {", ".join(outputs)} ]\n{extra}\n')


# ---------------------------------------------------------------- platform and backend


@pytest.mark.parametrize("names, backend, model_file", [
    ('platform: "onnxruntime_onnx"', "onnxruntime", "model.onnx"),
    ('backend: "onnxruntime"', "onnxruntime", "model.onnx"),
    ('platform: "pytorch_libtorch"', "pytorch", "model.pt"),
    ('backend: "pytorch"', "pytorch", "model.pt"),
    ('platform: "tensorrt_plan"', "tensorrt", "model.plan"),
    ('backend: "tensorrt"', "tensorrt", "model.plan"),
    ('platform: "python"', "python", "model.py"),
    ('backend: "python"', "python", "model.py"),
    ('platform: "pytorch_libtorch" backend: "pytorch"', "pytorch", "model.pt"),
])
def test_platform_and_backend_names_both_work(tmp_path, names, backend, model_file):
    cfg = config("m", [tensor("INPUT__0", [4])], [tensor("OUTPUT__0", [4])], backend=names)
    model = write_model(tmp_path, "m", cfg)
    (model / "1" / model_file).write_bytes(b"not parsed when the config is complete")
    if backend == "onnxruntime":  # auto-complete reads the graph: no graph, no completion
        specs = load_model(model, auto_complete=False)
    else:
        specs = load_model(model)
    assert [(s.backend, s.path) for s in specs] == [(backend, str(model / "1" / model_file))]


def test_platform_and_backend_that_disagree_are_refused_naming_both(tmp_path):
    cfg = config("m", [tensor("x", [4])], [tensor("y", [4])],
                 backend='platform: "pytorch_libtorch" backend: "onnxruntime"')
    model = write_model(tmp_path, "m", cfg)
    with pytest.raises(ConfigError, match="platform 'pytorch_libtorch' and backend "
                                          "'onnxruntime' disagree"):
        load_model(model)


@pytest.mark.parametrize("names, message", [
    ('platform: "tensorflow_savedmodel"', "platform 'tensorflow_savedmodel' is not supported"),
    ('backend: "openvino"', "backend 'openvino' is not supported"),
    ("", "names neither a backend nor a platform"),
])
def test_unknown_platform_or_backend_is_named(tmp_path, names, message):
    model = write_model(tmp_path, "m", config("m", [tensor("x", [4])], [tensor("y", [4])],
                                              backend=names), IDENTITY_CODE)
    with pytest.raises(ConfigError, match=message):
        load_model(model, auto_complete=False)


def test_tensorrt_instances_are_gpu_instances(tmp_path):
    cfg = config("m", [tensor("x", [4])], [tensor("y", [4])], backend='platform: "tensorrt_plan"',
                 extra="instance_group [ { kind: KIND_CPU } ]")
    model = write_model(tmp_path, "m", cfg)
    (model / "1" / "model.plan").write_bytes(b"plan")
    with pytest.raises(ConfigError, match="KIND_CPU: a tensorrt_plan model runs on a GPU"):
        load_model(model)
    (model / "config.pbtxt").write_text(cfg.replace("KIND_CPU", "KIND_GPU"))
    assert [s.backend for s in load_model(model)] == ["tensorrt"]


# ---------------------------------------------------------------- versions


def versioned(tmp_path, policy="", present=(1, 2, 3, 5), empty=()):
    model = write_model(tmp_path, "v", python_config("v", extra=policy), IDENTITY_CODE,
                        versions=present)
    for name in ("0", "07", "abc", *map(str, empty)):  # not versions, or versions without a file
        (model / name).mkdir()
    return model


@pytest.mark.parametrize("policy, versions", [
    ("", [5]),  # latest { num_versions: 1 }, Triton's default
    ("version_policy: { latest: { num_versions: 2 } }", [3, 5]),
    ("version_policy: { latest: { num_versions: 9 } }", [1, 2, 3, 5]),
    ("version_policy: { all: { } }", [1, 2, 3, 5]),
    ("version_policy: { specific: { versions: [ 3, 1 ] } }", [1, 3]),
])
def test_version_policy_selects_the_versions_triton_would(tmp_path, policy, versions):
    """Directories that are not a number, or start with 0, are not versions."""
    assert [s.version for s in load_model(versioned(tmp_path, policy))] == versions


def test_a_specific_version_that_does_not_exist_is_named(tmp_path, caplog):
    """As Triton: an error naming it is logged, the versions that exist are served."""
    model = versioned(tmp_path, "version_policy: { specific: { versions: [ 2, 4 ] } }")
    with caplog.at_level(logging.ERROR, logger="shmserve.repository"):
        assert [s.version for s in load_model(model)] == [2]
    assert "names version 4" in caplog.text and f"{model}/4 does not exist" in caplog.text


def test_specific_versions_none_of_which_exist_are_an_error(tmp_path):
    model = versioned(tmp_path, "version_policy: { specific: { versions: [ 4, 6 ] } }")
    with pytest.raises(ConfigError, match="names versions 4, 6, none of which exists"):
        load_model(model)


def test_a_selected_version_without_its_model_file_is_unavailable_alone(tmp_path):
    """latest picks the highest version directory, as Triton does, even one without
    its model file: that version cannot be served (a problem naming the file), the
    other selected versions are."""
    model = versioned(tmp_path, "version_policy: { latest: { num_versions: 2 } }", empty=(7,))
    specs, problems = scan_repository(tmp_path)
    assert [(s.name, s.version) for s in specs] == [("v", 5)]
    assert [(p.name, p.version) for p in problems] == [("v", 7)]
    assert f"{model}/7/model.py: missing" in problems[0].reason
    with pytest.raises(ConfigError, match="7/model.py: missing"):
        load_model(model)  # alone, without a list for problems, it raises


def test_default_model_filename_picks_the_file(tmp_path):
    model = write_model(tmp_path, "m", python_config("m", extra='default_model_filename: "net.py"'))
    (model / "1" / "net.py").write_text(IDENTITY_CODE)
    assert [s.path for s in load_model(model)] == [str(model / "1" / "net.py")]


# ---------------------------------------------------------------- reshape rules


@pytest.mark.parametrize("dims, shape", [
    ((4,), (2, 2)), ((1,), ()), ((2, 4, -1, 6), (8, -1, 1, 6)), ((-1, 4), (-1, 2, 2)),
])
def test_reshapes_triton_accepts(dims, shape):
    assert reshape.check(dims, shape) is None


@pytest.mark.parametrize("dims, shape", [((4,), (3,)), ((-1, 4), (4, -1)), ((2, -1), (-1,)),
                                         ((4,), (0, 4))])
def test_reshapes_triton_refuses(dims, shape):
    assert reshape.check(dims, shape)


def test_reshape_moves_variable_dims_both_ways():
    t = TensorSpec("x", 11, (2, 4, -1, 6), reshape=(8, -1, 1, 6))
    arr = np.arange(3 * 2 * 4 * 5 * 6).reshape(3, 2, 4, 5, 6)
    model = reshape.to_model(t, arr, batched=True)
    assert model.shape == (3, 8, 5, 1, 6)
    np.testing.assert_array_equal(reshape.to_caller(t, model, batched=True), arr)


def test_a_reshape_that_changes_the_element_count_is_refused(tmp_path):
    cfg = config("m", [tensor("INPUT0", [4], extra="reshape: { shape: [ 3 ] }")],
                 [tensor("OUTPUT0", [4])])
    model = write_model(tmp_path, "m", cfg, IDENTITY_CODE)
    with pytest.raises(ConfigError, match="input 'INPUT0' reshape \\[3\\] does not hold the "
                                          "elements of dims \\[4\\]"):
        load_model(model)


# ---------------------------------------------------------------- warmup and labels at parse

WARM_INPUT = tensor("INPUT0", [4])


def warm_model(tmp_path, samples: str, inputs=(WARM_INPUT,)):
    cfg = config("w", list(inputs), [tensor("OUTPUT0", [4])], extra=f"model_warmup [ {samples} ]")
    return write_model(tmp_path, "w", cfg, IDENTITY_CODE)


def sample(name="s", batch_size=1, dims="[ 4 ]", data="zero_data: true", key="INPUT0",
           dtype="TYPE_FP32", more=""):
    return (f'{{ name: "{name}" batch_size: {batch_size} {more} inputs {{ key: "{key}" value: '
            f'{{ data_type: {dtype} dims: {dims} {data} }} }} }}')


@pytest.mark.parametrize("samples, message", [
    (sample(key="NOPE"), "model_warmup 's': input 'NOPE' is not an input of the model"),
    (sample(dtype="TYPE_INT32"), "input 'INPUT0' has data_type TYPE_INT32, the model's input is "
                                 "TYPE_FP32"),
    (sample(dims="[ 5 ]"), "input 'INPUT0' dims \\[5\\] do not fit the input's dims \\[4\\]"),
    (sample(data='input_data_file: "absent.bin"'), "input_data_file .*absent.bin does not exist"),
    (sample(data='input_data_file: "../config.pbtxt"'), "is outside"),
    (sample(batch_size=9), "batch_size 9 exceeds max_batch_size 8"),
    (sample(data=""), "input 'INPUT0' gives no data"),
])
def test_warmup_samples_are_checked_at_parse(tmp_path, samples, message):
    with pytest.raises(ConfigError, match=message):
        load_model(warm_model(tmp_path, samples))


def test_warmup_must_give_every_input_that_is_not_optional(tmp_path):
    inputs = (WARM_INPUT, tensor("INPUT1", [4]), tensor("INPUT2", [4], extra="optional: true"))
    with pytest.raises(ConfigError, match="gives no data for input 'INPUT1'"):
        load_model(warm_model(tmp_path, sample(), inputs))


def test_warmup_batch_size_zero_is_skipped(tmp_path):
    [spec] = load_model(warm_model(tmp_path, sample(batch_size=0) + ", " + sample("t", 2)))
    assert [(s["name"], s["batch_size"], s["count"]) for s in spec.warmup] == [("t", 2, 1)]


def test_label_filename_is_kept_and_read(tmp_path):
    cfg = config("c", [tensor("INPUT0", [3])],
                 [tensor("OUTPUT0", [3], extra='label_filename: "labels.txt"')])
    model = write_model(tmp_path, "c", cfg, IDENTITY_CODE)
    with pytest.raises(ConfigError, match="label_filename 'labels.txt': no such file"):
        load_model(model)
    (model / "labels.txt").write_text("cat\ndog\nbird\n")
    [spec] = load_model(model)
    assert spec.outputs[0].label_filename == "labels.txt"
    assert spec.labels("OUTPUT0") == ["cat", "dog", "bird"]
    assert spec.config().output[0].label_filename == "labels.txt"


# ---------------------------------------------------------------- served

RECORDING_CODE = '''
import json
from pathlib import Path


class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        with open(Path(__file__).with_name("calls.jsonl"), "a") as f:
            f.write(json.dumps({"shape": list(x.shape), "values": x.reshape(-1).tolist()}) + "\\n")
        return {"OUTPUT0": x}
'''

FAILING_CODE = '''
class TritonPythonModel:
    def execute(self, inputs):
        raise ValueError("not warm yet")
'''

OPTIONAL_CODE = '''
class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        if "INPUT1" in inputs:  # left out: the model gets no entry for it
            return {"OUTPUT0": x + inputs["INPUT1"]}
        return {"OUTPUT0": -x}
'''

RESHAPE_CODE = '''
class TritonPythonModel:
    def execute(self, inputs):
        a, b, c = inputs["A"], inputs["B"], inputs["C"]
        assert a.shape[1:] == (2, 2), a.shape  # dims [4], reshape [2, 2]
        assert b.ndim == 4 and b.shape[2:] == (2, 2), b.shape  # [-1, 4] -> [-1, 2, 2]
        assert c.ndim == 1, c.shape  # [1] -> []
        return {"A2": a * 2, "B1": b + 1, "C3": c * 3}
'''


def write_served_models(repo):
    write_model(repo, "identity", python_config("identity", dims=(4,)), IDENTITY_CODE)
    model = write_model(repo, "warm", config(
        "warm", [WARM_INPUT], [tensor("OUTPUT0", [4])],
        extra="model_warmup [ " + ", ".join([
            sample("zeros", 3, more="count: 2"),
            sample("file", 1, data='input_data_file: "row.bin"'),
            sample("random", 2, data="random_data: true"),
            sample("skipped", 0)]) + " ]"), RECORDING_CODE)
    (model / "warmup").mkdir()
    (model / "warmup" / "row.bin").write_bytes(struct.pack("<4f", 1, 2, 3, 4))
    write_model(repo, "cold", config("cold", [WARM_INPUT], [tensor("OUTPUT0", [4])],
                                     extra="model_warmup [ " + sample("boom") + " ]"),
                FAILING_CODE)
    write_model(repo, "opt", config(
        "opt", [tensor("INPUT0", [-1]), tensor("INPUT1", [-1], extra="optional: true")],
        [tensor("OUTPUT0", [-1])], extra="dynamic_batching { max_queue_delay_microseconds: 20000 }"),
        OPTIONAL_CODE)
    write_model(repo, "shaped", config(
        "shaped", [tensor("A", [4], extra="reshape: { shape: [ 2, 2 ] }"),
                   tensor("B", [-1, 4], extra="reshape: { shape: [ -1, 2, 2 ] }"),
                   tensor("C", [1], extra="reshape: { shape: [ ] }")],
        [tensor("A2", [4], extra="reshape: { shape: [ 2, 2 ] }"),
         tensor("B1", [-1, 4], extra="reshape: { shape: [ -1, 2, 2 ] }"),
         tensor("C3", [1], extra="reshape: { shape: [ ] }")],
        extra="dynamic_batching { max_queue_delay_microseconds: 20000 }"), RESHAPE_CODE)
    labels = write_model(repo, "labeled", config(
        "labeled", [tensor("INPUT0", [3])],
        [tensor("OUTPUT0", [3], extra='label_filename: "labels.txt"')]), IDENTITY_CODE)
    (labels / "labels.txt").write_text("cat\ndog\nbird\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, write_served_models, "fidelity")


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def test_warmup_runs_before_the_model_is_ready(server, client):
    """Each sample ran `count` times (0: once) with batch_size rows of its data, before
    any request: zeros, the file's row, random values in [0, 1); batch_size 0 skipped."""
    states = {m["name"]: m["state"] for m in client.models()}
    assert states["warm"] == "READY", states
    calls = [json.loads(line) for line in
             (server.repo / "warm" / "1" / "calls.jsonl").read_text().splitlines()]
    assert [c["shape"] for c in calls] == [[3, 4], [3, 4], [1, 4], [2, 4]]  # in config order
    by_shape = {}
    for c in calls:
        by_shape.setdefault(tuple(c["shape"]), []).append(c["values"])
    assert by_shape[(3, 4)] == [[0.0] * 12] * 2
    assert by_shape[(1, 4)] == [[1.0, 2.0, 3.0, 4.0]]
    assert all(0.0 <= v < 1.0 for v in by_shape[(2, 4)][0])
    x = np.arange(4, dtype=np.float32)[None]
    np.testing.assert_array_equal(client.infer("warm", [x])["OUTPUT0"], x)


def test_a_failing_warmup_makes_the_model_unavailable_with_the_reason(client):
    states = {m["name"]: m["state"] for m in client.models()}
    assert states["cold"].startswith("UNAVAILABLE: "), states
    assert "model_warmup 'boom' failed" in states["cold"], states["cold"]
    assert "ValueError: not warm yet" in states["cold"], states["cold"]
    with pytest.raises(errors.UnavailableError, match="'cold'"):
        client.infer("cold", [np.zeros((1, 4), np.float32)], timeout=20)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(client.infer("identity", [x])["OUTPUT0"], x)


def test_an_optional_input_may_be_left_out(client):
    x, y = np.array([[1.0, 2.0]], np.float32), np.array([[10.0, 20.0]], np.float32)
    np.testing.assert_array_equal(client.infer("opt", {"INPUT0": x})["OUTPUT0"], -x)
    np.testing.assert_array_equal(client.infer("opt", {"INPUT0": x, "INPUT1": y})["OUTPUT0"], x + y)
    with pytest.raises(errors.InvalidArgumentError,
                       match="missing input 'INPUT0' \\(it is not optional\\)"):
        client.infer("opt", {"INPUT1": y})


def test_requests_with_and_without_an_optional_input_batch_apart(client):
    """Concurrent requests, some leaving INPUT1 out: each gets its own answer (they
    are never batched with requests that give other inputs)."""
    futures = []
    for i in range(8):
        x = np.full((1, 3), float(i), np.float32)
        inputs = {"INPUT0": x} if i % 2 else {"INPUT0": x, "INPUT1": x}
        futures.append((i, client.submit("opt", inputs)))
    for i, f in futures:
        want = np.full((1, 3), -float(i) if i % 2 else 2.0 * i, np.float32)
        np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], want)


def test_reshape_gives_the_model_its_shape_and_callers_theirs(client):
    """Inputs reach the model in the reshape shape, outputs come back in the dims,
    for a batch of several requests too (variable dims carried across)."""
    futures = []
    for rows, n in ((1, 3), (2, 3), (3, 3)):
        a = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        b = np.arange(rows * n * 4, dtype=np.float32).reshape(rows, n, 4)
        c = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        futures.append(((a, b, c), client.submit("shaped", {"A": a, "B": b, "C": c})))
    for (a, b, c), f in futures:
        out = f.result(timeout=30)
        np.testing.assert_array_equal(out["A2"], a * 2)
        np.testing.assert_array_equal(out["B1"], b + 1)
        np.testing.assert_array_equal(out["C3"], c * 3)


def test_label_filename_is_in_the_served_config(client):
    assert 'label_filename: "labels.txt"' in client.model_config("labeled")
