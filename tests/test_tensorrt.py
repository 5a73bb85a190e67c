"""The tensorrt backend. Where the machine lacks a GPU, TensorRT or cupy, a
tensorrt_plan model is UNAVAILABLE with exactly that reason and the other models
serve (nothing crashes, nothing hangs). On a GPU machine with TensorRT 10 and cupy
(`pytest -m gpu`), an engine built here is served and checked against its
arithmetic; elsewhere that test skips, saying what is missing."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import IDENTITY_CODE, python_config, write_model

from shmserve import errors
from shmserve.backends.tensorrt_backend import missing_pieces

pytestmark = pytest.mark.timeout(180)
MISSING = missing_pieces()

PLAN_CONFIG = '''name: "{name}"
platform: "tensorrt_plan"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
instance_group [ {{ kind: KIND_GPU }} ]
'''


def plan_model(repo, name: str, plan: bytes):
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.plan").write_bytes(plan)
    (model_dir / "config.pbtxt").write_text(PLAN_CONFIG.format(name=name))


@pytest.mark.skipif(not MISSING, reason="this machine has a GPU, TensorRT and cupy")
def test_without_what_it_needs_the_model_is_unavailable_with_the_reason(server_factory):
    def setup(repo):
        plan_model(repo, "plan", b"an engine nobody here can deserialize")
        write_model(repo, "identity", python_config("identity", dims=(4,)), IDENTITY_CODE)

    server = server_factory(models=(), setup=setup)
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["identity"] == "READY", states
        reason = states["plan"]
        assert reason.startswith("UNAVAILABLE: UnavailableError: model 'plan' version 1: a "
                                 "tensorrt_plan model runs on an NVIDIA GPU with TensorRT, and "), reason
        for piece in MISSING:  # every missing piece, in its words
            assert piece in reason, (piece, reason)
        with pytest.raises(errors.UnavailableError, match="'plan'"):
            c.infer("plan", [np.zeros((1, 4), np.float32)], timeout=20)
        x = np.arange(4, dtype=np.float32)[None]
        np.testing.assert_array_equal(c.infer("identity", [x])["OUTPUT0"], x)


def build_doubling_engine(max_batch: int) -> bytes:
    """A TensorRT 10 engine: OUTPUT0 = INPUT0 + INPUT0, INPUT0 [-1, 4] FP32, one
    optimization profile for batches 1..max_batch."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    x = network.add_input("INPUT0", trt.float32, (-1, 4))
    total = network.add_elementwise(x, x, trt.ElementWiseOperation.SUM).get_output(0)
    total.name = "OUTPUT0"
    network.mark_output(total)
    profile = builder.create_optimization_profile()
    profile.set_shape("INPUT0", (1, 4), (max_batch, 4), (max_batch, 4))
    config = builder.create_builder_config()
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "TensorRT could not build the test engine"
    return bytes(plan)


@pytest.mark.gpu
@pytest.mark.skipif(bool(MISSING), reason="needs a GPU, TensorRT 10 and cupy: "
                    + "; ".join(MISSING))
def test_a_built_engine_serves_batched_requests(server_factory):
    def setup(repo):
        plan_model(repo, "double", build_doubling_engine(8))
        plan_model(repo, "narrow", build_doubling_engine(4))  # profile below max_batch_size

    server = server_factory(models=(), setup=setup)
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["double"] == "READY", server.log()
        assert "optimization profile 0 allows batches up to 4, max_batch_size is 8" \
            in states["narrow"], states["narrow"]
        rng = np.random.default_rng(0)
        pending = []
        for rows in (1, 3, 8, 2):
            x = rng.random((rows, 4), np.float32)
            pending.append((x, c.submit("double", [x])))
        for x, f in pending:
            np.testing.assert_array_equal(f.result(timeout=60)["OUTPUT0"], x + x)
