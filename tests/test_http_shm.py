"""Triton's system shared memory extension on the HTTP front, with Triton's own client
(tritonclient.http) and its shared-memory utilities (tritonclient.utils.shared_memory):
register / status / unregister, inputs read from regions and outputs written into
them for several data types, one registry for every front process (a region registered
through one connection serves requests that land on another front, and is unmapped by
each front once unregistered), and every error with Triton's words. Every region a test
creates is destroyed (and unregistered) even when the test fails."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

import helpers
from helpers import python_config, wait_until, write_model
from test_http_front import fronts_of, raw, wait_live
from test_metrics import free_port

th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
shm = pytest.importorskip("tritonclient.utils.shared_memory",
                          reason="tritonclient's shared memory utilities are not installed")
from tritonclient.utils import (InferenceServerException, serialize_byte_tensor,  # noqa: E402
                               serialized_byte_size, triton_to_np_dtype)

pytestmark = pytest.mark.timeout(240)

# One identity model per type, beside simple (INT32) and identity (FP32).
DTYPES = ["INT8", "UINT16", "INT64", "FP16", "FP64", "BOOL", "BYTES"] + (
    ["BF16"] if helpers.HAVE_BF16 else [])


def setup_models(repo) -> None:
    for dt in DTYPES:
        write_model(repo, f"id_{dt}", python_config(f"id_{dt}", dt, (-1,), max_batch_size=8),
                    helpers.IDENTITY_CODE)


@pytest.fixture(scope="module")
def front(tmp_path_factory, mlp_onnx):
    """One server, two HTTP front processes sharing the port (--http-thread-count 2)."""
    def write(repo):
        helpers.copy_bundled(repo, mlp_onnx, names=("simple", "identity"))
        setup_models(repo)

    def connect(server, port):
        client = wait_live(server, port)
        wait_until(lambda: len(fronts_of(server)) == 2, 60, "both HTTP fronts started")
        return client

    port = free_port()
    yield from helpers.front_server(tmp_path_factory, write, "shm", port,
                                    ["--http-port", str(port), "--http-thread-count", "2"],
                                    connect)


class Regions:
    """Shared memory objects of one test, created with tritonclient's utilities and all
    destroyed (and unregistered from the server) at the end, whatever happened."""

    def __init__(self, client):
        self.client = client
        self.handles = []
        self.tag = f"shmtest_{os.getpid()}_{uuid.uuid4().hex[:8]}"

    def key(self, name: str) -> str:
        return f"/{self.tag}_{name}"

    def create(self, name: str, byte_size: int, register: bool = True, offset: int = 0,
               register_bytes: int | None = None):
        handle = shm.create_shared_memory_region(name, self.key(name), byte_size)
        self.handles.append(handle)
        if register:
            self.client.register_system_shared_memory(
                name, self.key(name), register_bytes or byte_size - offset, offset=offset)
        return handle

    def close(self) -> None:
        try:
            self.client.unregister_system_shared_memory()
        finally:
            for handle in self.handles:
                shm.destroy_shared_memory_region(handle)
            left = [h for h in os.listdir("/dev/shm") if h.startswith(self.tag)]
            assert not left, f"shared memory objects left behind: {left}"


@pytest.fixture
def regions(front):
    r = Regions(front[1])
    try:
        yield r
    finally:
        r.close()


def contents(handle, dtype, shape, offset: int = 0) -> np.ndarray:
    """A copy of a region's contents (a view would keep the object from being closed)."""
    return np.array(shm.get_contents_as_numpy(handle, dtype, shape, offset=offset))


def error_of(call, *args, **kw) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        call(*args, **kw)
    return e.value


def test_register_status_unregister(front, regions):
    _, client, _ = front
    assert "system_shared_memory" in client.get_server_metadata()["extensions"]
    assert client.get_system_shared_memory_status() == []
    regions.create("a", 64)
    regions.create("b", 4096, offset=1024, register_bytes=128)
    status = client.get_system_shared_memory_status()
    assert status == [
        {"name": "a", "key": regions.key("a"), "offset": 0, "byte_size": 64},
        {"name": "b", "key": regions.key("b"), "offset": 1024, "byte_size": 128}]
    assert client.get_system_shared_memory_status("b") == [status[1]]
    e = error_of(client.get_system_shared_memory_status, "nope")
    assert e.status() == "404"
    assert "Unable to find system shared memory region: 'nope'" in e.message()
    e = error_of(client.register_system_shared_memory, "a", regions.key("b"), 8)
    assert e.status() == "400" and "shared memory region 'a' already in manager" in e.message()
    client.unregister_system_shared_memory("a")
    client.unregister_system_shared_memory("a")  # unknown: no error, as Triton
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["b"]
    client.register_system_shared_memory("a", regions.key("a"), 64)  # the name is free again
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def simple_request(regions, in_offset: int = 0):
    """Triton's simple_http_shm_client: both inputs in one region, both outputs in
    another; returns (inputs, outputs, input0, input1, output handle)."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    h_in = regions.create("input", in_offset + 128, offset=in_offset)
    h_out = regions.create("output", 128)
    shm.set_shared_memory_region(h_in, [a, b], offset=in_offset)
    inputs = [th.InferInput("INPUT0", [1, 16], "INT32"), th.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input", 64)
    inputs[1].set_shared_memory("input", 64, offset=64)
    outputs = [th.InferRequestedOutput("OUTPUT0", binary_data=True),
               th.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory("output", 64)
    outputs[1].set_shared_memory("output", 64, offset=64)
    return inputs, outputs, a, b, h_out


def test_infer_inputs_and_outputs_in_regions(front, regions):
    _, client, _ = front
    inputs, outputs, a, b, h_out = simple_request(regions, in_offset=4096 + 8)
    result = client.infer("simple", inputs, outputs=outputs)
    out0 = result.get_output("OUTPUT0")
    # Listed without data: the region says where the bytes are.
    assert out0 == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16],
                    "parameters": {"shared_memory_region": "output",
                                   "shared_memory_byte_size": 64}}
    got0 = contents(h_out, np.int32, [1, 16])
    got1 = contents(h_out, np.int32, [1, 16], offset=64)
    np.testing.assert_array_equal(got0, a + b)
    np.testing.assert_array_equal(got1, a - b)
    # Mixed: one input in shared memory, one as binary data; one output in shared
    # memory, the other as JSON.
    mixed = [inputs[0], th.InferInput("INPUT1", [1, 16], "INT32")]
    mixed[1].set_data_from_numpy(np.full((1, 16), 5, np.int32), binary_data=True)
    shm.set_shared_memory_region(h_out, [np.zeros((1, 32), np.int32)])
    result = client.infer("simple", mixed, outputs=[
        outputs[0], th.InferRequestedOutput("OUTPUT1", binary_data=False)])
    np.testing.assert_array_equal(contents(h_out, np.int32, [1, 16]), a + 5)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 5)
    # A bigger output region than the answer needs is fine; the response says how much.
    outputs[0].set_shared_memory("output", 128)
    result = client.infer("simple", inputs, outputs=[outputs[0]])
    assert result.get_output("OUTPUT0")["parameters"]["shared_memory_byte_size"] == 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_infer_dtypes_through_regions(front, regions, dtype):
    _, client, _ = front
    rng = np.random.default_rng(7)
    if dtype == "BYTES":
        data = np.array([b"", b"shm", "caf\u00e9".encode(), bytes(range(256))], dtype=object)
        data = data.reshape(1, 4)
        nbytes = serialized_byte_size(serialize_byte_tensor(data))  # as Triton's examples
    else:
        np_dtype = {"BF16": np.float32}.get(dtype) or triton_to_np_dtype(dtype)
        data = (rng.integers(0, 2, (2, 5)).astype(bool) if dtype == "BOOL" else
                rng.integers(-100, 100, (2, 5)).astype(np_dtype))
        nbytes = data.nbytes if dtype != "BF16" else data.size * 2
    if dtype == "BF16":  # tritonclient writes BF16 from float32 arrays through its own dtype
        import ml_dtypes

        data = data.astype(ml_dtypes.bfloat16)
    h_in = regions.create("in", 8192)
    h_out = regions.create("out", 8192)
    if dtype == "BYTES":
        shm.set_shared_memory_region(h_in, [serialize_byte_tensor(data)], offset=24)
    else:
        shm.set_shared_memory_region(h_in, [data.view(np.uint8).reshape(-1)], offset=24)
    inp = th.InferInput("INPUT0", list(data.shape), dtype)
    inp.set_shared_memory("in", nbytes, offset=24)
    out = th.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("out", 8192 - 40, offset=40)
    result = client.infer(f"id_{dtype}", [inp], outputs=[out])
    meta = result.get_output("OUTPUT0")
    assert meta["datatype"] == dtype and meta["shape"] == list(data.shape)
    assert meta["parameters"]["shared_memory_byte_size"] == nbytes
    if dtype == "BYTES":
        got = contents(h_out, np.object_, data.shape, offset=40)
    else:
        raw_out = contents(h_out, np.uint8, [nbytes], offset=40)
        got = raw_out.view(data.dtype).reshape(data.shape)
    np.testing.assert_array_equal(got, data)


def _mapped_keys(pid: int, tag: str) -> set[str]:
    """The /dev/shm objects of this test a process has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if tag in line}


def test_regions_are_shared_by_every_front(front, regions):
    """Registered through one connection, used by requests on new connections (the
    kernel spreads them over both fronts); re-registered under the same name with other
    data, every front reads the new object; unregistered, every front unmaps it."""
    server, client, port = front
    fronts = fronts_of(server)
    assert len(fronts) == 2
    h_a = regions.create("data_a", 64, register=False)
    h_b = regions.create("data_b", 64, register=False)
    shm.set_shared_memory_region(h_a, [np.arange(16, dtype=np.float32)])
    shm.set_shared_memory_region(h_b, [np.full(16, -2.0, np.float32)])
    client.register_system_shared_memory("data", regions.key("data_a"), 64)

    def infer_on_new_connections(n: int, expected):
        for _ in range(n):
            c = th.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                inp = th.InferInput("INPUT0", [1, 16], "FP32")
                inp.set_shared_memory("data", 64)
                out = c.infer("identity", [inp]).as_numpy("OUTPUT0")
            finally:
                c.close()
            np.testing.assert_array_equal(out, expected.reshape(1, 16))

    infer_on_new_connections(40, np.arange(16, dtype=np.float32))
    key_a = f"/dev/shm{regions.key('data_a')}"
    assert all(key_a in _mapped_keys(pid, regions.tag) for pid in fronts), \
        "each front maps the region it serves"
    # Another object under the same name, registered through yet another connection.
    other = th.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        other.unregister_system_shared_memory("data")
        other.register_system_shared_memory("data", regions.key("data_b"), 64)
    finally:
        other.close()
    infer_on_new_connections(40, np.full(16, -2.0, np.float32))
    client.unregister_system_shared_memory()
    # A front drops its mappings when it next looks at the registry (any status call).
    for _ in range(40):
        c = th.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert c.get_system_shared_memory_status() == []
        finally:
            c.close()
    for pid in fronts:
        assert _mapped_keys(pid, regions.tag) == set(), f"front {pid} still maps a region"
    assert fronts_of(server) == fronts  # no front died on the way


def test_register_errors(front, regions):
    _, client, port = front
    regions.create("small", 64, register=False)
    key = regions.key("small")
    cases = [
        (("x", regions.key("nope"), 8), {}, "Unable to open shared memory region: "
                                            f"'{regions.key('nope')}'"),
        (("x", "bad/key", 8), {}, "Unable to open shared memory region: 'bad/key'"),
        (("x", key, 65), {}, "failed to register shared memory region 'x': invalid args"),
        (("x", key, 64), {"offset": 1}, "failed to register shared memory region 'x': invalid args"),
        (("x", key, 1), {"offset": 64}, "failed to register shared memory region 'x': invalid args"),
        (("x", "/shmserve-0-abc-srv", 8), {}, "reserved prefix 'shmserve-'"),
    ]
    for args, kw, words in cases:
        e = error_of(client.register_system_shared_memory, *args, **kw)
        assert e.status() == "400" and words in e.message(), (args, e)
    region = "/v2/systemsharedmemory/region/x/register"
    for body, words in [(b"{not json", "failed to parse the request JSON buffer"),
                        (b'{"byte_size": 8}', "no 'key' field"),
                        (b'{"key": "/k"}', "no 'byte_size' field"),
                        (b'{"key": "/k", "byte_size": -1}', "Unable to parse 'byte_size'"),
                        (b'{"key": 5, "byte_size": 1}', "Unable to parse 'key'"),
                        (b'{"key": "/k", "byte_size": 18446744073709551616}',
                         "failed to register shared memory region 'x': invalid args")]:
        status, reply = raw(port, "POST", region, body)
        assert status == 400 and words in reply["error"], (body, reply)
    status, reply = raw(port, "POST", "/v2/systemsharedmemory/register", b'{"key": "/k"}')
    assert status == 400 and "'region name' is necessary" in reply["error"]
    assert raw(port, "POST", "/v2/systemsharedmemory/status")[0] == 405
    assert raw(port, "GET", "/v2/systemsharedmemory/unregister")[0] == 405
    assert client.get_system_shared_memory_status() == []


def test_infer_errors(front, regions):
    _, client, port = front
    inputs, outputs, a, b, h_out = simple_request(regions)

    def infer_error(words: str, status: str = "400", inputs=inputs, outputs=outputs):
        e = error_of(client.infer, "simple", inputs, outputs=outputs)
        assert e.status() == status and words in e.message(), e
        return e

    inputs[0].set_shared_memory("nope", 64)
    infer_error("Unable to find shared memory region: 'nope'", "404")
    inputs[0].set_shared_memory("input", 64, offset=128)
    infer_error("Invalid offset for shared memory region: 'input'")
    inputs[0].set_shared_memory("input", 64, offset=100)
    infer_error("Invalid offset + byte size for shared memory region: 'input'")
    # tritonclient keeps an offset once set (it sends only non-zero ones): new inputs
    inputs[0] = th.InferInput("INPUT0", [1, 16], "INT32").set_shared_memory("input", 128)
    infer_error("input byte size mismatch for input 'INPUT0' for model 'simple'. "
                "Expected 64, got 128")
    inputs[0] = th.InferInput("INPUT0", [1, 16], "INT32").set_shared_memory("input", 64)
    outputs[1].set_shared_memory("output", 32, offset=64)
    infer_error("shared memory size specified with the request for output 'OUTPUT1' "
                "(32 bytes) should be at least 64 bytes to hold the results")
    outputs[1].set_shared_memory("output", 64, offset=2**64 - 32)
    infer_error("Invalid offset for shared memory region: 'output'")
    outputs[1].set_shared_memory("output", 2**64 - 32, offset=32)
    infer_error("Invalid offset + byte size for shared memory region: 'output'")
    outputs[1].set_shared_memory("output", 64, offset=64)
    # Requests Triton's client cannot build, sent by hand.
    infer = "/v2/models/simple/infer"
    sm = {"shared_memory_region": "input", "shared_memory_byte_size": 64}
    tensor = {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32"}
    for spec, words in [
            ({**tensor, "parameters": sm, "data": list(range(16))}, "Input must set only one"),
            ({**tensor, "parameters": {"shared_memory_region": "input"}},
             "'shared_memory_byte_size' must be specified along with 'shared_memory_region'"),
            ({**tensor, "parameters": {"shared_memory_offset": 0}, "data": list(range(16))},
             "'shared_memory_offset' can not be specified without 'shared_memory_region'"),
            ({**tensor, "parameters": {**sm, "shared_memory_byte_size": -64}},
             "Unable to parse 'shared_memory_byte_size'"),
            ({**tensor, "parameters": {**sm, "shared_memory_region": 7}},
             "Unable to parse 'shared_memory_region'")]:
        body = {"inputs": [spec, {**tensor, "name": "INPUT1", "parameters": sm}]}
        status, reply = raw(port, "POST", infer, json_bytes(body))
        assert status == 400 and words in reply["error"], (spec, reply)
    body = {"inputs": [{**tensor, "parameters": sm}, {**tensor, "name": "INPUT1", "parameters": sm}],
            "outputs": [{"name": "OUTPUT0", "parameters": {
                "shared_memory_region": "output", "shared_memory_byte_size": 64,
                "binary_data": True}}]}
    status, reply = raw(port, "POST", infer, json_bytes(body))
    assert status == 400 and "can't set both 'shared_memory_region' and 'binary_data'" in \
        reply["error"]
    # An object shrunk by its owner after registration is refused, never read past its end.
    os.truncate(f"/dev/shm{regions.key('input')}", 16)
    infer_error("'input': its object")
    # Nothing else broke: the same requests work with good regions.
    regions.client.unregister_system_shared_memory("input")
    inputs, outputs, a, b, h_out = simple_request_again(regions)
    client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(contents(h_out, np.int32, [1, 16]), a + b)
    assert client.is_server_ready()


def simple_request_again(regions):
    """simple_request with objects of new names (the old ones stay until the end)."""
    regions.client.unregister_system_shared_memory()
    regions.tag += "x"
    return simple_request(regions)


def json_bytes(obj) -> bytes:
    import json

    return json.dumps(obj).encode()


def test_cuda_shared_memory_needs_a_gpu_build(front):
    _, client, port = front
    status, reply = raw(port, "POST", "/v2/cudasharedmemory/region/c/register",
                        json_bytes({"raw_handle": {"b64": "AAAA"}, "device_id": 0,
                                    "byte_size": 8}))
    assert status == 400 and "CUDA shared memory needs a GPU build" in reply["error"]
    status, reply = raw(port, "POST", "/v2/cudasharedmemory/register", b"{}")
    assert status == 400 and "'region name' is necessary" in reply["error"]
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()  # succeeds: perf_analyzer does it at start
    e = error_of(client.get_cuda_shared_memory_status, "c")
    assert e.status() == "404" and "Unable to find cuda shared memory region: 'c'" in e.message()


def test_read_input_copies_once_into_the_arena(tmp_path):
    """The front's one copy: region bytes land in the array `empty` gave (the arena's);
    the region's view is released (an unregistered region can be unmapped)."""
    from shmserve.front.shm import OutputTarget, Region, SystemSharedMemory

    path = tmp_path / "obj"
    path.write_bytes(bytes(range(64)))
    st = os.stat(path)
    region = Region({"name": "r", "key": "/obj", "offset": 8, "byte_size": 32,
                     "dev": st.st_dev, "ino": st.st_ino})
    assert region.map(str(path))
    memory = SystemSharedMemory(client=None)
    memory._regions = {"r": region}
    given = []

    def empty(shape, dtype):
        given.append(np.zeros(shape, dtype))
        return given[-1]

    arr = memory.read_input("r", 4, 16, name="X", datatype="UINT8", dtype=np.dtype(np.uint8),
                            shape=(16,), model="m", empty=empty)
    assert arr is given[0] and list(arr) == list(range(12, 28))
    memory.write_output(OutputTarget(region, 0, 32), "Y", np.full(4, 255, np.uint8), "UINT8")
    assert path.read_bytes()[8:12] == b"\xff" * 4
    region.mm.close()  # no view of it is left: closing does not raise BufferError
