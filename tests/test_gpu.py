"""GPU instances (server/devices.py, docs/gpu.md).

On every machine: the planning of instances onto devices (Triton's instance_group
rules: count per listed GPU, KIND_AUTO, CUDA_VISIBLE_DEVICES), the worker environment,
what python models see in initialize's args, and that a KIND_GPU model on a machine
without a GPU is UNAVAILABLE with the reason while the others serve. On a GPU machine
(`pytest -m gpu`, scripts/gpu_check.sh): every backend on the device against the
framework run directly, and a worker crash on the GPU answered and restarted; elsewhere
those skip, saying what is missing.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from google.protobuf import text_format
from helpers import gpu_torch, IDENTITY_CODE, python_config, write_affine, write_model
from tritonclient.grpc import model_config_pb2 as mc

from shmserve import errors
from shmserve.backends import Instance
from shmserve.backends.python_backend import initialize_args
from shmserve.errors import ConfigError
from shmserve.server import devices
from shmserve.server.repository import load_model

pytestmark = pytest.mark.timeout(180)
GPUS = devices.visible_gpus()


def plan(groups: str, backend="onnxruntime", gpus=(0, 1, 2)):
    cfg = text_format.Parse(groups, mc.ModelConfig())
    return devices.instance_devices(cfg, backend, "model 'm'", gpus=gpus), cfg


# ---------------------------------------------------------------- planning (any machine)

@pytest.mark.parametrize("groups, backend, gpus, expected", [
    ("instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 2 ] } ]", "onnxruntime", (0, 1, 2),
     (0, 0, 2, 2)),  # count instances on each listed GPU
    ("instance_group [ { kind: KIND_GPU } ]", "pytorch", (0, 1), (0, 1)),  # every visible GPU
    ("instance_group [ { kind: KIND_GPU count: 2 }, { kind: KIND_CPU count: 3 } ]",
     "onnxruntime", (0,), (0, 0, -1, -1, -1)),
    ("instance_group [ { count: 2 } ]", "onnxruntime", (0, 1), (0, 0, 1, 1)),  # AUTO: GPUs
    ("instance_group [ { count: 2 } ]", "onnxruntime", (), (-1, -1)),  # AUTO, no GPU: CPU
    ("", "python", (0,), (0,)),  # no group: one instance per visible GPU, as Triton
    ("", "python", (), (-1,)),
    ("", "tensorrt", (), (0,)),  # a plan runs on a GPU or nowhere: planned, then UNAVAILABLE
    ("instance_group [ { kind: KIND_GPU } ]", "python", (), (0,)),
])
def test_instances_are_planned_as_triton_plans_them(groups, backend, gpus, expected):
    assert plan(groups, backend, gpus)[0] == expected


def test_the_served_config_shows_the_groups_completed():
    """KIND_AUTO resolved and a GPU group's gpus listed, as Triton's config API shows them."""
    _, cfg = plan("instance_group [ { count: 2 }, { kind: KIND_GPU } ]", gpus=(0, 1))
    assert [(g.kind, list(g.gpus)) for g in cfg.instance_group] == [
        (mc.ModelInstanceGroup.KIND_GPU, [0, 1]), (mc.ModelInstanceGroup.KIND_GPU, [0, 1])]
    _, cfg = plan("instance_group [ { count: 2 } ]", gpus=())
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


@pytest.mark.parametrize("groups, backend, message", [
    ("instance_group [ { kind: KIND_GPU gpus: [ 3 ] } ]", "onnxruntime",
     r"model 'm': instance_group lists GPU 3, which this server does not see \(visible GPUs: "
     r"\[0, 1, 2\]\)"),
    ("instance_group [ { name: \"g\" kind: KIND_CPU gpus: [ 0 ] } ]", "onnxruntime",
     r"instance_group 'g' kind KIND_CPU lists gpus \[0\]: a CPU instance takes no GPU"),
    ("instance_group [ { kind: KIND_CPU } ]", "tensorrt", r"KIND_CPU: a tensorrt_plan model runs "
     r"on a GPU"),
    ("instance_group [ { kind: KIND_MODEL } ]", "onnxruntime", r"kind KIND_MODEL is not supported"),
    ("instance_group [ { count: -1 } ]", "onnxruntime", r"instance_group count must be >= 1"),
])
def test_impossible_groups_are_refused_by_name(groups, backend, message):
    with pytest.raises(ConfigError, match=message):
        plan(groups, backend)


@pytest.mark.parametrize("value, expected", [
    ("2,0", [2, 0]), ("1", [1]), ("", []), ("-1", []),
    ("0,7,1", [0]),  # CUDA stops at the first entry that names no device
    ("GPU-bbb", [1]), ("GPU-a,1", [0, 1]), ("0,0", [0]),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, expected):
    assert devices._parse_visible(value, 3, ["GPU-aaa", "GPU-bbb", "GPU-ccc"]) == expected


def test_a_worker_sees_only_its_gpu_unless_model_code_picks_it(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.worker_environment("onnxruntime", 1) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert devices.worker_environment("onnxruntime", devices.CPU) == {}
    assert devices.worker_environment("python", 1) == {}  # args["model_instance_device_id"]
    assert devices.local_ordinal("pytorch", 1) == 0 and devices.local_ordinal("python", 1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the server's GPU 1 is physical 5
    assert devices.worker_environment("tensorrt", 1) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_python_models_get_triton_s_instance_args(tmp_path):
    """kind, device id and instance name as Triton gives them to a GPU instance."""
    model = write_model(tmp_path, "p", python_config(
        "p", extra='instance_group [ { name: "cpu" count: 1 kind: KIND_CPU }, '
                   '{ name: "gpu" count: 2 kind: KIND_GPU gpus: [ 0 ] } ]'), IDENTITY_CODE)
    [spec] = load_model(model)
    assert spec.devices == (-1, 0, 0) and spec.instance_count == 3
    args = initialize_args(spec, Instance(index=2, device=0))
    assert (args["model_instance_kind"], args["model_instance_device_id"],
            args["model_instance_name"]) == ("GPU", "0", "gpu_1")
    groups = json.loads(args["model_config"])["instance_group"]
    assert [(g["kind"], g.get("gpus", [])) for g in groups] == [("KIND_CPU", []), ("KIND_GPU", [0])]
    cpu = initialize_args(spec, Instance(index=0))
    assert (cpu["model_instance_kind"], cpu["model_instance_name"]) == ("CPU", "cpu_0")


# ---------------------------------------------------------------- without a GPU

REPORTER_CODE = '''
import json, os
import numpy as np

class TritonPythonModel:
    def initialize(self, args):
        self.seen = json.dumps({k: args[k] for k in ("model_instance_kind",
                                "model_instance_device_id", "model_instance_name")}
                               | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})

    def execute(self, inputs):
        n = inputs["INPUT0"].shape[0]
        return {"OUTPUT0": np.array([self.seen.encode()] * n, dtype=object).reshape(n, 1)}
'''


def reporter(repo, name, group):
    write_model(repo, name, python_config(name, dims=(1,), out_dtype="BYTES",
                                          extra=f"instance_group [ {group} ]"), REPORTER_CODE)


@pytest.mark.skipif(bool(GPUS), reason="this machine has a GPU (the gpu tests below run)")
def test_without_a_gpu_gpu_instances_are_unavailable_with_the_reason(server_factory, mlp_onnx):
    def setup(repo):
        reporter(repo, "on_gpu", "{ kind: KIND_GPU }")
        reporter(repo, "auto", "{ count: 2 }")
        (repo / "ort_gpu" / "1").mkdir(parents=True)
        shutil.copy(mlp_onnx, repo / "ort_gpu" / "1" / "model.onnx")
        (repo / "ort_gpu" / "config.pbtxt").write_text(
            'backend: "onnxruntime"\nmax_batch_size: 8\ninstance_group [ { kind: KIND_GPU } ]\n')

    server = server_factory(setup=setup, args=["--exit-on-error=false",
                                               "--pinned-memory-pool-byte-size", "268435456"])
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["identity"] == "READY" and states["auto"] == "READY", states
        assert states["on_gpu"].startswith("UNAVAILABLE: UnavailableError: model 'on_gpu' version "
                                           "1: instance 0 is on GPU 0, which this machine does not "
                                           "show"), states["on_gpu"]
        assert "a GPU instance needs ONNX Runtime's CUDAExecutionProvider" in states["ort_gpu"] \
            or "which this machine does not show" in states["ort_gpu"], states["ort_gpu"]
        with pytest.raises(errors.UnavailableError, match="'on_gpu'"):
            c.infer("on_gpu", [np.zeros((1, 1), np.float32)], timeout=20)
        seen = json.loads(c.infer("auto", [np.zeros((1, 1), np.float32)])["OUTPUT0"][0, 0])
        assert seen["model_instance_kind"] == "CPU" and seen["CUDA_VISIBLE_DEVICES"] is None
    assert "--pinned-memory-pool-byte-size 268435456 is ignored" in server.log()


def test_cuda_pool_sizes_are_read_as_triton_writes_them(capsys):
    from shmserve import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--cuda-memory-pool-byte-size", "0=1024", "repo"])
    assert "write <GPU number>:<bytes>" in capsys.readouterr().err
    assert cli._cuda_pool("1:67108864") == (1, 67108864)


# ---------------------------------------------------------------- on a GPU

TORCH = gpu_torch()
needs_gpu = pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible (NVML through "
                                                "nvidia-ml-py): scripts/gpu_check.sh runs these")


@pytest.mark.gpu
@needs_gpu
def test_python_gpu_instances_see_their_device(server_factory):
    def setup(repo):
        reporter(repo, "on_gpu", f"{{ kind: KIND_GPU count: 2 gpus: [ {GPUS[-1]} ] }}")

    server = server_factory(setup=setup)
    with server.client() as c:
        seen = json.loads(c.infer("on_gpu", [np.zeros((1, 1), np.float32)])["OUTPUT0"][0, 0])
    assert seen["model_instance_kind"] == "GPU"
    assert seen["model_instance_device_id"] == str(GPUS[-1])
    assert seen["model_instance_name"] in ("on_gpu_0_0", "on_gpu_0_1")


@pytest.mark.gpu
@needs_gpu
def test_onnxruntime_on_the_gpu_equals_the_cpu(server_factory, mlp_onnx):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime here has no CUDAExecutionProvider (pip install onnxruntime-gpu)")

    def setup(repo):
        (repo / "mlp_gpu" / "1").mkdir(parents=True)
        shutil.copy(mlp_onnx, repo / "mlp_gpu" / "1" / "model.onnx")
        (repo / "mlp_gpu" / "config.pbtxt").write_text(
            'backend: "onnxruntime"\nmax_batch_size: 32\ninstance_group [ { kind: KIND_GPU } ]\n')

    server = server_factory(models=("mlp",), setup=setup)
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    with server.client() as c:
        on_gpu, on_cpu = c.infer("mlp_gpu", [x]), c.infer("mlp", [x])
    for name in on_cpu:
        np.testing.assert_allclose(on_gpu[name], on_cpu[name], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(TORCH is None, reason="torch with CUDA and a GPU are needed")
def test_pytorch_on_the_gpu_equals_torch(server_factory):
    def setup(repo):
        write_affine(repo, TORCH, 'platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
                     'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                     'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                     'instance_group [ { kind: KIND_GPU } ]\n')

    server = server_factory(setup=setup)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with server.client() as c:
        np.testing.assert_array_equal(c.infer("affine", [x])["OUTPUT__0"], x * 2 + 1)


CRASH_ON_NEGATIVE = '''
import os

class TritonPythonModel:
    def execute(self, inputs):
        if (inputs["INPUT0"] < 0).any():
            os._exit(3)
        return {"OUTPUT0": inputs["INPUT0"]}
'''


@pytest.mark.gpu
@needs_gpu
def test_a_worker_crash_on_the_gpu_is_answered_and_restarted(server_factory):
    from helpers import wait_until

    def setup(repo):
        write_model(repo, "crashy", python_config(
            "crashy", extra="instance_group [ { kind: KIND_GPU } ]"), CRASH_ON_NEGATIVE)

    server = server_factory(setup=setup)
    with server.client() as c:
        with pytest.raises(errors.ShmServeError, match="crashy"):
            c.infer("crashy", [-np.ones((1, 2), np.float32)], timeout=30)
        wait_until(lambda: all(m["state"] == "READY" for m in c.models()), 60,
                   "the restarted GPU worker to be READY")
        x = np.ones((1, 2), np.float32)
        np.testing.assert_array_equal(c.infer("crashy", [x], timeout=30)["OUTPUT0"], x)
