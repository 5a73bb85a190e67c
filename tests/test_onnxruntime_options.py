"""ONNX Runtime session options from the config, named as Triton's onnxruntime
backend names them: thread counts, execution mode, memory options, the graph
optimization level, execution accelerators. Checked on the session the backend
builds, on outputs (equal to bare onnxruntime's) and, for an accelerator this
onnxruntime lacks, on a served model that is UNAVAILABLE with the reason."""
from __future__ import annotations

import logging
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from shmserve import errors
from shmserve.backends import load_backend
from shmserve.errors import ConfigError
from shmserve.server.repository import load_model

pytestmark = pytest.mark.timeout(120)

MLP_CONFIG = '''name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
{extra}
'''


def param(key, value):
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def mlp(repo, mlp_onnx, extra="", name="m"):
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(mlp_onnx, model_dir / "1" / "model.onnx")
    (model_dir / "config.pbtxt").write_text(MLP_CONFIG.format(name=name, extra=extra))
    return model_dir


def backend(model_dir):
    [spec] = load_model(model_dir)
    return load_backend(spec)


def test_parameters_become_session_options(tmp_path, mlp_onnx):
    b = backend(mlp(tmp_path, mlp_onnx, param("intra_op_thread_count", 2)
                    + param("inter_op_thread_count", 3) + param("execution_mode", 1)
                    + param("enable_mem_arena", "false") + param("enable_mem_pattern", "0")
                    + param("session.use_device_allocator_for_initializers", "1")
                    + param("memory.enable_memory_arena_shrinkage", "cpu:0")))
    opts = b.session.get_session_options()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (2, 3)
    assert opts.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert opts.enable_cpu_mem_arena is False and opts.enable_mem_pattern is False
    assert opts.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    assert b.run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"


def test_defaults_keep_one_thread_per_instance(tmp_path, mlp_onnx):
    opts = backend(mlp(tmp_path, mlp_onnx)).session.get_session_options()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (1, 1)
    assert opts.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


@pytest.mark.parametrize("level, expected", [
    (-1, "ORT_ENABLE_BASIC"), (1, "ORT_ENABLE_EXTENDED"), (2, "ORT_DISABLE_ALL"),
    (0, "ORT_ENABLE_ALL"),
])
def test_graph_level_as_triton_maps_it(tmp_path, mlp_onnx, level, expected):
    b = backend(mlp(tmp_path, mlp_onnx, f"optimization {{ graph {{ level: {level} }} }}"))
    assert b.session.get_session_options().graph_optimization_level == getattr(
        ort.GraphOptimizationLevel, expected)


def test_outputs_equal_bare_onnxruntime_whatever_the_options(tmp_path, mlp_onnx):
    x = np.random.default_rng(0).random((3, 256), np.float32)
    want = ort.InferenceSession(str(mlp_onnx), providers=["CPUExecutionProvider"]).run(
        ["OUTPUT0"], {"INPUT0": x})[0]
    b = backend(mlp(tmp_path, mlp_onnx, "optimization { graph { level: 2 } }\n"
                    + param("execution_mode", 1) + param("intra_op_thread_count", 2)))
    np.testing.assert_allclose(b.execute({"INPUT0": x})["OUTPUT0"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra, message", [
    (param("intra_op_thread_count", "two"), 'parameters "intra_op_thread_count" must be an '
                                            'integer'),
    (param("execution_mode", 2), 'parameters "execution_mode" must be one of 0, 1, got 2'),
    (param("enable_mem_arena", "maybe"), 'parameters "enable_mem_arena" must be "true" or "false"'),
    ('optimization { execution_accelerators { cpu_execution_accelerator [ { name: "mkldnn" } ] } }',
     "cpu_execution_accelerator 'mkldnn' is unknown"),
])
def test_bad_options_are_refused_by_name_at_parse(tmp_path, mlp_onnx, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_model(mlp(tmp_path, mlp_onnx, extra))


def test_gpu_accelerators_are_ignored_with_a_warning(tmp_path, mlp_onnx, caplog):
    """Triton applies them to GPU instances only; instances here are CPU ones."""
    extra = ('optimization { execution_accelerators { gpu_execution_accelerator [ '
             '{ name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } }, '
             '{ name: "cuda" } ] } }')
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        b = backend(mlp(tmp_path, mlp_onnx, extra))
    for name in ("tensorrt", "cuda"):
        assert f"gpu_execution_accelerator '{name}' is ignored" in caplog.text, caplog.text
    assert b.session.get_providers() == ["CPUExecutionProvider"]


OPENVINO = ('optimization { execution_accelerators { cpu_execution_accelerator [ '
            '{ name: "openvino" } ] } }')


def test_openvino_without_its_provider_makes_the_model_unavailable(server_factory, mlp_onnx):
    """This onnxruntime has no OpenVINOExecutionProvider: the model asking for it is
    UNAVAILABLE, naming what is missing; the one beside it serves."""
    if "OpenVINOExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the OpenVINO execution provider")

    def setup(repo):
        mlp(repo, mlp_onnx, OPENVINO, name="vino")
        mlp(repo, mlp_onnx, param("intra_op_thread_count", 2), name="plain")

    server = server_factory(models=(), setup=setup)
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["plain"] == "READY", states
        assert states["vino"].startswith("UNAVAILABLE: UnavailableError: "), states
        assert "cpu_execution_accelerator 'openvino' needs ONNX Runtime's " \
               "OpenVINOExecutionProvider" in states["vino"], states["vino"]
        with pytest.raises(errors.UnavailableError, match="'vino'"):
            c.infer("vino", [np.zeros((1, 256), np.float32)], timeout=20)
        x = np.ones((2, 256), np.float32)
        want = ort.InferenceSession(str(mlp_onnx), providers=["CPUExecutionProvider"]).run(
            ["OUTPUT0"], {"INPUT0": x})[0]
        np.testing.assert_allclose(c.infer("plain", [x])["OUTPUT0"], want, rtol=1e-5, atol=1e-6)
