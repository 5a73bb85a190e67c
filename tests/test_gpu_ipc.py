"""Callers' device tensors by CUDA IPC and page-locked arenas (gpu/ipc.py, docs/gpu.md).

On every machine: which models take device memory, and that a device tensor the
client cannot send (no driver, a strided one, a bad destination) is refused by name
before anything reaches the server. On a GPU machine (scripts/gpu_check.sh): a torch
tensor on the GPU as input and as output destination, computed on in place; host and
device requests batched together; a 64 MiB tensor through a 1 MiB arena (the tensor's
bytes never pass through the arena); a forged record fails its own request only; a
caller that dies with allocations opened by the worker leaves no device memory behind.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest
from helpers import gpu_torch, wait_until, write_affine

from shmserve import errors
from shmserve.gpu import ipc
from shmserve.server import devices
from shmserve.protocol import DataType
from shmserve.server.repository import ModelSpec, TensorSpec

pytestmark = pytest.mark.timeout(180)


TORCH = gpu_torch()
needs_gpu = pytest.mark.skipif(TORCH is None, reason="torch with CUDA and a GPU are needed: "
                                                     "scripts/gpu_check.sh runs these")
AFFINE = ('platform: "pytorch_libtorch"\nmax_batch_size: 64\n'
          'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
          'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
          'instance_group [ { kind: KIND_GPU } ]\n'
          'dynamic_batching { max_queue_delay_microseconds: 2000 }\n')


# ---------------------------------------------------------------- any machine

def spec(**kw) -> ModelSpec:
    base = dict(name="m", version=1, backend="pytorch", path="/x/model.pt", max_batch_size=8,
                inputs=(TensorSpec("x", DataType.FP32, (4,)),),
                outputs=(TensorSpec("y", DataType.FP32, (4,)),), devices=(0,), instance_count=1,
                dynamic_batching=True, preferred_batch_sizes=(), max_queue_delay_us=0,
                parameters={}, config_text="")
    base.update(kw)
    return ModelSpec(**base)


@pytest.mark.parametrize("change, takes", [
    ({}, True),
    ({"devices": (0, 0, 1)}, True),
    ({"devices": (0, devices.CPU)}, False),  # a CPU instance could get the request
    ({"devices": ()}, False),
    ({"backend": "onnxruntime", "path": "/x/model.onnx"}, False),
    ({"response_cache": True}, False),  # the cache key hashes host bytes
    ({"outputs": (TensorSpec("y", DataType.BYTES, (1,)),)}, False),
])
def test_models_that_take_device_memory(change, takes):
    assert spec(**change).device_memory is takes


class FakeDeviceTensor:
    """Says it is device memory, but no driver (or no such pointer) backs it."""

    def __init__(self, strides=None):
        self.__cuda_array_interface__ = {"shape": (1, 4), "typestr": "<f4", "version": 3,
                                         "data": (0x7F0000001000, False), "strides": strides,
                                         "stream": 1}


def test_a_device_tensor_the_client_cannot_send_is_refused_by_name(main_server):
    with main_server.client() as c:
        with pytest.raises(errors.InvalidArgumentError,
                           match="model 'identity' input 'INPUT0': cannot send this device tensor"):
            c.infer("identity", {"INPUT0": FakeDeviceTensor()})
        with pytest.raises(errors.InvalidArgumentError, match="strided device tensor"):
            c.infer("identity", {"INPUT0": FakeDeviceTensor(strides=(4, 8))})
        x = np.ones((1, 4), np.float32)
        with pytest.raises(errors.InvalidArgumentError,
                           match="output 'OUTPUT0': a destination must be a device tensor"):
            c.infer("identity", {"INPUT0": x}, outputs={"OUTPUT0": np.empty((1, 4), np.float32)})
        # a mapping of names to None asks for those outputs in the arena
        got = c.infer("identity", {"INPUT0": x}, outputs={"OUTPUT0": None})
        np.testing.assert_array_equal(got["OUTPUT0"], x)


def test_handles_keep_their_nul_bytes():
    from shmserve.gpu import driver
    handle = bytes(range(64))  # binary, NULs included
    assert driver.handle_bytes(driver.handle_of(handle)) == handle
    with pytest.raises(driver.CudaError, match="64 bytes"):
        driver.handle_of(b"short")


def test_the_record_is_the_layout_s():
    record = ipc.RECORD.pack(b"h" * 64, b"e" * 64, 4096, b"u" * 16, ipc.EVENT, 0)
    assert len(record) == 160
    handle, event, offset, uuid, flags, _ = ipc.RECORD.unpack(record)
    assert (offset, flags) == (4096, 1)


# ---------------------------------------------------------------- on a GPU

@pytest.fixture
def affine(server_factory):
    return server_factory(setup=lambda repo: write_affine(repo, TORCH, AFFINE))


@pytest.mark.gpu
@needs_gpu
def test_device_inputs_are_read_in_place_and_outputs_written_into_the_callers_tensor(affine):
    torch = TORCH
    x = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(4, 1024)
    with affine.client() as c:
        host = c.infer("affine", {"x": x})["OUTPUT__0"]  # device in, arena out
        np.testing.assert_array_equal(host, (x * 2 + 1).cpu().numpy())
        out = torch.empty_like(x)
        got = c.infer("affine", {"x": x}, outputs={"OUTPUT__0": out})["OUTPUT__0"]
        assert got is out  # written in place, where the caller asked
        assert torch.equal(out, x * 2 + 1)
        # on a stream of the caller's: the server waits for the caller's writes (event)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            y = torch.full((2, 1024), 3.0, device="cuda")
            torch.cuda._sleep(10_000_000)  # the caller's stream still busy when it submits
            y += 1
            got = c.infer("affine", {"x": y}, outputs={"OUTPUT__0": torch.empty_like(y)})
        stream.synchronize()
        assert torch.equal(got["OUTPUT__0"], torch.full_like(y, 9.0))


@pytest.mark.gpu
@needs_gpu
def test_host_and_device_requests_batch_together(affine):
    torch = TORCH
    with affine.client() as c:
        futures, expected = [], []
        for i in range(48):
            x = np.full((1, 256), i, np.float32)
            value = torch.from_numpy(x).cuda() if i % 2 else x
            futures.append(c.submit("affine", {"x": value}))
            expected.append(x * 2 + 1)
        for future, want in zip(futures, expected):
            np.testing.assert_array_equal(future.result(timeout=60)["OUTPUT__0"], want)
        (st,) = c.statistics("affine")
    assert st["execution_count"] < st["inference_count"]  # they did batch


@pytest.mark.gpu
@needs_gpu
def test_device_tensors_never_pass_through_the_arena(affine):
    torch = TORCH
    x = torch.rand((1, 16 << 20), device="cuda")  # 64 MiB, through a 1 MiB arena
    out = torch.empty_like(x)
    with affine.client(arena_bytes=1 << 20) as c:
        c.infer("affine", {"x": x}, outputs={"OUTPUT__0": out})
    assert torch.equal(out, x * 2 + 1)


@pytest.mark.gpu
@needs_gpu
def test_a_forged_record_fails_its_own_request_only(affine, monkeypatch):
    torch = TORCH
    x = torch.ones((1, 64), device="cuda")
    honest = ipc.DeviceSource.record
    with affine.client() as c:
        monkeypatch.setattr(ipc.DeviceSource, "record",
                            lambda self, event: b"\x5a" * 64 + honest(self, event)[64:])
        with pytest.raises(errors.InvalidArgumentError,
                           match="input 'x': cannot open its CUDA IPC handle"):
            c.infer("affine", {"x": x})

        def past_the_end(self, event):
            r = bytearray(honest(self, event))
            r[128:136] = (1 << 40).to_bytes(8, "little")
            return bytes(r)

        monkeypatch.setattr(ipc.DeviceSource, "record", past_the_end)
        with pytest.raises(errors.InvalidArgumentError, match="outside its device allocation"):
            c.infer("affine", {"x": x})
        monkeypatch.setattr(ipc.DeviceSource, "record", honest)
        got = c.infer("affine", {"x": x}, outputs={"OUTPUT__0": torch.empty_like(x)})
        assert torch.equal(got["OUTPUT__0"], x * 2 + 1)


def _dying_caller(name: str, socket_path: str, ready) -> None:
    import torch

    from shmserve import Client
    c = Client(name, socket_path_=socket_path)
    x = torch.ones((1, 256 << 20), device="cuda")  # 1 GiB each, opened by the worker
    c.infer("affine", {"x": x}, outputs={"OUTPUT__0": torch.empty_like(x)})
    ready.set()
    time.sleep(0.5)
    os._exit(0)  # no close: the lease ends with the process


@pytest.mark.gpu
@needs_gpu
def test_a_caller_dying_with_handles_open_leaks_nothing(affine):
    torch = TORCH
    # The same request from here first: the worker's own torch allocator then holds
    # the blocks such a request needs (its output), before the baseline is taken.
    x = torch.ones((1, 256 << 20), device="cuda")
    with affine.client() as c:
        c.infer("affine", {"x": x}, outputs={"OUTPUT__0": torch.empty_like(x)})
    del x
    torch.cuda.empty_cache()
    time.sleep(3)  # the worker closes what it opened for that ended lease first (each second)
    free_before = torch.cuda.mem_get_info()[0]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_dying_caller, args=(affine.name, str(affine.socket_path), ready))
    child.start()
    assert ready.wait(120), "the caller never got its answer"
    child.join(60)
    # the worker closes what it opened for the dead lease (within about a second);
    # the 1 GiB allocation is freed only then
    wait_until(lambda: torch.cuda.mem_get_info()[0] > free_before - (256 << 20), 30,
               "the dead caller's device memory to be freed",
               state=lambda: (f"free {torch.cuda.mem_get_info()[0] >> 20} MiB, before "
                              f"{free_before >> 20} MiB; server log: {affine.log()[-2000:]}"))
