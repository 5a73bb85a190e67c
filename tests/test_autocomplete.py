"""Auto-complete of an ONNX model's configuration (issue 10): Triton serves an ONNX
model with no config.pbtxt, or one that leaves out input/output/max_batch_size, by
reading the graph; --disable-auto-complete-config (or --strict-model-config=true)
turns it off. The models are written here with onnx.helper (nothing downloaded)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.errors import ConfigError
from shmserve.server.repository import load_model, scan_repository

pytestmark = pytest.mark.timeout(120)


def write_onnx(path: Path, in_shape, out_shape, dtype="FLOAT") -> Path:
    """X (in_shape) -> Relu -> Y (out_shape): a None or str dim is symbolic."""
    import onnx
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, dtype)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["Y"])], "relu",
        [helper.make_tensor_value_info("X", elem, in_shape)],
        [helper.make_tensor_value_info("Y", elem, out_shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def onnx_model(repo: Path, name: str, in_shape, out_shape, config: str | None = None,
               dtype="FLOAT") -> Path:
    write_onnx(repo / name / "1" / "model.onnx", in_shape, out_shape, dtype)
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return repo / name


def tensors(spec):
    return ([(t.name, t.dtype_name, t.dims) for t in spec.inputs],
            [(t.name, t.dtype_name, t.dims) for t in spec.outputs])


def test_no_config_dynamic_batch_dim_gets_default_max_batch_size(tmp_path):
    [spec] = load_model(onnx_model(tmp_path, "dyn", ["batch", 3], [None, 3]))
    assert spec.name == "dyn" and spec.backend == "onnxruntime"
    assert spec.path == str(tmp_path / "dyn" / "1" / "model.onnx")
    assert spec.max_batch_size == 4  # Triton's default-max-batch-size
    assert spec.dynamic_batching  # turned on with the default, no scheduler configured
    assert tensors(spec) == ([("X", "FP32", (3,))], [("Y", "FP32", (3,))])
    cfg = text_format.Parse(spec.config_text, mc.ModelConfig())
    assert (cfg.name, cfg.platform, cfg.backend, cfg.default_model_filename) == \
        ("dyn", "onnxruntime_onnx", "onnxruntime", "model.onnx")
    assert cfg.max_batch_size == 4 and list(cfg.input[0].dims) == [3]


def test_no_config_fixed_dims_is_not_batched(tmp_path):
    [spec] = load_model(onnx_model(tmp_path, "fixed", [2, 3], [2, 3], dtype="INT32"))
    assert spec.max_batch_size == 0 and not spec.dynamic_batching
    assert tensors(spec) == ([("X", "INT32", (2, 3))], [("Y", "INT32", (2, 3))])


def test_variable_dims_after_the_first_stay_minus_one(tmp_path):
    [spec] = load_model(onnx_model(tmp_path, "seq", ["b", "t", 4], ["b", "t", 4]))
    assert spec.max_batch_size == 4
    assert tensors(spec) == ([("X", "FP32", (-1, 4))], [("Y", "FP32", (-1, 4))])


def test_config_with_name_and_backend_only_is_completed(tmp_path):
    [spec] = load_model(onnx_model(tmp_path, "named", ["batch", 5], ["batch", 5],
                                   'name: "named"\nbackend: "onnxruntime"\n'))
    assert spec.max_batch_size == 4
    assert tensors(spec) == ([("X", "FP32", (5,))], [("Y", "FP32", (5,))])


def test_config_max_batch_size_and_dims_are_kept(tmp_path):
    config = ('platform: "onnxruntime_onnx"\nmax_batch_size: 16\n'
              'input [ { name: "X" data_type: TYPE_FP32 dims: [ 5 ] } ]\n')
    [spec] = load_model(onnx_model(tmp_path, "partial", ["batch", 5], ["batch", 5], config))
    assert spec.max_batch_size == 16 and not spec.dynamic_batching  # config said its word
    assert tensors(spec) == ([("X", "FP32", (5,))], [("Y", "FP32", (5,))])


def test_config_dims_with_full_rank_mean_no_batching(tmp_path):
    config = ('backend: "onnxruntime"\n'
              'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 5 ] } ]\n')
    [spec] = load_model(onnx_model(tmp_path, "nobatch", ["batch", 5], ["batch", 5], config))
    assert spec.max_batch_size == 0
    assert tensors(spec) == ([("X", "FP32", (-1, 5))], [("Y", "FP32", (-1, 5))])


def test_config_disagreeing_with_the_graph_names_the_tensor(tmp_path):
    def refused(name, shape, config, pattern):
        with pytest.raises(ConfigError) as e:
            load_model(onnx_model(tmp_path, name, shape, shape, 'backend: "onnxruntime"\n' + config))
        assert re.search(pattern, e.value.msg), e.value.msg

    refused("bad_type", ["batch", 5],
            'max_batch_size: 8\ninput [ { name: "X" data_type: TYPE_INT64 dims: [ 5 ] } ]\n',
            r"bad_type/config\.pbtxt: input 'X' has data_type TYPE_INT64 in the config but "
            r"TYPE_FP32 in the ONNX graph")
    refused("bad_name", ["batch", 5], 'output [ { name: "Z" data_type: TYPE_FP32 dims: [ 5 ] } ]\n',
            r"bad_name/config\.pbtxt: output 'Z' is not an output of the ONNX graph .*\['Y'\]")
    refused("batch_fixed", [2, 5], "max_batch_size: 8\n",
            r"batch_fixed/config\.pbtxt: max_batch_size 8 but .*tensor 'X'")


def test_disabled_auto_complete_refuses_a_model_without_config(tmp_path):
    model_dir = onnx_model(tmp_path, "bare", ["batch", 3], ["batch", 3])
    with pytest.raises(ConfigError, match=r"bare/config\.pbtxt: missing .*auto-complete"):
        load_model(model_dir, auto_complete=False)
    specs, problems = scan_repository(tmp_path, auto_complete=False)
    assert not specs and [p.name for p in problems] == ["bare"]
    # a config that leaves out the tensors is not completed either
    (model_dir / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    with pytest.raises(ConfigError, match="declares no input"):
        load_model(model_dir, auto_complete=False)


def test_no_config_and_no_onnx_file_names_the_directory(tmp_path):
    (tmp_path / "empty" / "1").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"empty/config\.pbtxt: missing, and no "
                                          r"<version>/model\.onnx"):
        load_model(tmp_path / "empty")


def test_cli_spellings():
    from shmserve import cli

    seen = []

    def fake_run(opts):
        seen.append(opts.auto_complete_config)
        return 0

    import shmserve.server.coordinator as coordinator
    mp = pytest.MonkeyPatch()
    mp.setattr(coordinator, "run", fake_run)
    try:
        for extra in ([], ["--disable-auto-complete-config"], ["--strict-model-config=true"],
                      ["--strict-model-config", "false"], ["--strict-model-config"]):
            assert cli.main(["serve", "--model-repository", "x", *extra]) == 0
    finally:
        mp.undo()
    assert seen == [True, False, False, True, False]


def test_served_auto_completed_models(server_factory):
    """End to end: a batched model without config.pbtxt answers a [2, k] request as
    onnxruntime does, its completed config is what model_config() shows, and with
    --disable-auto-complete-config the same repository is refused naming the model."""
    import onnxruntime as ort

    def setup(repo):
        onnx_model(repo, "auto_dyn", ["batch", 6], ["batch", 6])
        onnx_model(repo, "auto_fixed", [3], [3])

    server = server_factory(models=("identity",), setup=setup)
    x = np.array([[-1, 2, -3, 4, -5, 6], [7, -8, 9, -10, 11, -12]], np.float32)
    sess = ort.InferenceSession(str(server.repo / "auto_dyn" / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    [expected] = sess.run(["Y"], {"X": x})
    with server.client(arena_bytes=1 << 20) as c:
        out = c.infer("auto_dyn", {"X": x}, copy=True)
        np.testing.assert_array_equal(out["Y"], expected)
        meta = c.model_metadata("auto_dyn")
        assert meta["max_batch_size"] == 4
        assert meta["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 6]}]
        cfg = text_format.Parse(c.model_config("auto_dyn"), mc.ModelConfig())
        assert cfg.max_batch_size == 4 and cfg.platform == "onnxruntime_onnx"
        assert [(t.name, list(t.dims)) for t in cfg.output] == [("Y", [6])]
        out = c.infer("auto_fixed", {"X": np.array([-1, 0, 2], np.float32)}, copy=True)
        np.testing.assert_array_equal(out["Y"], np.array([0, 0, 2], np.float32))
        assert c.model_metadata("auto_fixed")["max_batch_size"] == 0

    refused = server_factory(repo=server.repo, args=["--disable-auto-complete-config"],
                             start=False)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        refused.start()
    assert re.search(r"auto_dyn/config\.pbtxt: missing", refused.log()), refused.log()
