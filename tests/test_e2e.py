"""End-to-end round trips through a real server (the shared `main_server`)."""
from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from google.protobuf import text_format
from helpers import DTYPES, HAVE_BF16
from tritonclient.grpc import model_config_pb2 as mc

import shmserve
from shmserve import errors

pytestmark = pytest.mark.timeout(60)


def sample(dtype: str, rows: int = 3, cols: int = 7, seed: int = 0) -> np.ndarray:
    """Data of a Triton dtype, with the awkward values of that type included."""
    rng = np.random.default_rng(seed)
    shape = (rows, cols)
    if dtype == "BOOL":
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype == "BYTES":
        pool = [b"", b"\x00", b"\xff\xfe\x00x", "héllo".encode(), b"a" * 1000, b"tail"]
        return np.array([pool[i % len(pool)] + bytes([seed % 256]) * (i % 3)
                         for i in range(rows * cols)], dtype=object).reshape(shape)
    if dtype in ("FP16", "FP32", "FP64", "BF16"):
        # Arbitrary bit patterns: NaNs with payloads, infinities, -0, subnormals.
        width = {"FP16": 16, "BF16": 16, "FP32": 32, "FP64": 64}[dtype]
        bits = rng.integers(0, 2 ** 63, shape, dtype=np.uint64).astype(f"uint{width}")
        if dtype == "BF16":
            import ml_dtypes
            return bits.view(ml_dtypes.bfloat16)
        return bits.view({"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[dtype])
    info = np.iinfo(np.dtype(dtype.lower()))
    x = rng.integers(info.min, info.max, shape, dtype=np.dtype(dtype.lower()), endpoint=True)
    x.flat[0], x.flat[1] = info.min, info.max
    return x


def assert_bit_exact(out: np.ndarray, x: np.ndarray) -> None:
    assert out.shape == x.shape
    if x.dtype == object:
        assert out.dtype == object
        assert out.tolist() == x.tolist()
    else:
        assert out.dtype == x.dtype
        assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_bit_exact(client, dtype):
    if dtype == "BF16" and not HAVE_BF16:
        pytest.skip("BF16 needs ml_dtypes, which is not importable here")
    for rows in (1, 3, 16):
        x = sample(dtype, rows=rows, seed=rows)
        out = client.infer(f"id_{dtype}", {"INPUT0": x})
        assert_bit_exact(out["OUTPUT0"], x)
        assert out.model_name == f"id_{dtype}"


@pytest.mark.parametrize("dtype", ["INT64", "FP16", "BYTES", "BOOL"])
def test_dynamic_batch_is_split_back_to_each_caller(client, dtype):
    """Requests of different row counts batched together each get their own rows."""
    futures = []
    for i in range(24):
        x = sample(dtype, rows=1 + i % 4, cols=5, seed=100 + i)
        futures.append((x, client.submit(f"id_{dtype}", {"INPUT0": x})))
    for x, f in futures:
        assert_bit_exact(f.result(timeout=30)["OUTPUT0"], x)


def test_requests_of_different_shapes_never_mix(client):
    futures = []
    for i in range(30):
        x = np.full((1 + i % 2, 1 + i % 5), i, np.float32)
        futures.append((x, client.submit("id_FP32", [x])))
    for x, f in futures:
        assert_bit_exact(f.result(timeout=30)["OUTPUT0"], x)


def test_preferred_batch_size(client):
    """Four 1-row requests go out together as the preferred batch of 4, long before
    the 3 s max_queue_delay."""
    (row,) = client.statistics("preferred")
    before = dict(row["shmserve"]["batch_requests"])
    xs = [np.full((1, 3), i, np.float32) for i in range(4)]
    futures = [client.submit("preferred", [x]) for x in xs]
    for x, f in zip(xs, futures):
        assert_bit_exact(f.result(timeout=30)["OUTPUT0"], x)
    (row,) = client.statistics("preferred")
    grew = {k: v - before.get(k, 0) for k, v in row["shmserve"]["batch_requests"].items()}
    assert {k: v for k, v in grew.items() if v} == {"4": 1}


def test_instance_group_runs_instances_in_parallel(client, main_server):
    """instance_group count 2: two requests in flight at once run in two workers."""
    futures = [client.submit("twin", [np.ones((1, 2), np.float32)]) for _ in range(2)]
    pids = {int(f.result(timeout=30)["OUTPUT0"][0, 0]) for f in futures}
    assert len(pids) == 2
    assert pids <= set(main_server.members()) - {main_server.pid}


def test_large_tensor(make_client):
    c = make_client(arena_bytes=80 << 20)
    x = np.random.default_rng(0).standard_normal((2, 2 << 20)).astype(np.float32)  # 16 MiB
    assert_bit_exact(c.infer("identity", [x])["OUTPUT0"], x)


def test_non_contiguous_and_empty_inputs(client):
    base = np.arange(60, dtype=np.float32).reshape(3, 20)
    for x in (base[:, ::3], np.asfortranarray(base), base[::-1], base.T.copy().T):
        assert_bit_exact(client.infer("identity", [x])["OUTPUT0"], np.ascontiguousarray(x))
    assert client.infer("identity", [np.zeros((2, 0), np.float32)])["OUTPUT0"].shape == (2, 0)
    assert client.infer("id_BYTES", [np.zeros((1, 0), object)])["OUTPUT0"].shape == (1, 0)


def test_unbatched_model(client):
    meta = client.model_metadata("unbatched")
    assert meta["max_batch_size"] == 0
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "INT16", "shape": [2, -1]}]
    for cols in (1, 5, 300):
        x = np.arange(2 * cols, dtype=np.int16).reshape(2, cols) - 7
        assert_bit_exact(client.infer("unbatched", [x])["OUTPUT0"], x)
    # No batch dimension on an unbatched model: a leading 1 is a wrong rank.
    with pytest.raises(errors.InvalidArgumentError, match=r"'unbatched'.*'INPUT0'.*3 dimensions"):
        client.infer("unbatched", [np.zeros((1, 2, 3), np.int16)])
    with pytest.raises(errors.InvalidArgumentError, match=r"'INPUT0' dimension 0 is 3, expected 2"):
        client.infer("unbatched", [np.zeros((3, 3), np.int16)])


def test_simple_model_sum_and_difference(client):
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), -5, dtype=np.int32)
    out = client.infer("simple", {"INPUT0": a, "INPUT1": b})
    assert set(out) == {"OUTPUT0", "OUTPUT1"}
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    # inputs as a list in the model's input order, one output asked for
    only = client.infer("simple", [a, b], outputs=["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]
    np.testing.assert_array_equal(only["OUTPUT1"], a - b)
    np.testing.assert_array_equal(client.infer("simple", [a, b], outputs="OUTPUT0").as_numpy("OUTPUT0"), a + b)


def test_mlp_matches_bare_onnxruntime(client, main_repo):
    import onnxruntime as ort

    session = ort.InferenceSession(str(main_repo / "mlp" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for rows in (1, 5, 64):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        (expected,) = session.run(["OUTPUT0"], {"INPUT0": x})
        out = client.infer("mlp", {"INPUT0": x})["OUTPUT0"]
        assert out.shape == (rows, 16) and out.dtype == np.float32
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_empty_input_is_zero_copy(client):
    """An input allocated with empty() is read by the model where it lies: a change
    made after submit() (the sleeper reads its input only after sleeping) shows."""
    a = client.empty((1, 4), np.float32)
    a[:] = [0.5, 1, 2, 3]
    future = client.submit("sleeper", {"INPUT0": a})
    a[0, 1:] = 9
    np.testing.assert_array_equal(future.result(timeout=30)["OUTPUT0"], [[0.5, 9, 9, 9]])


def test_ordinary_input_is_copied_at_submit(client):
    """The counterpart: an array outside the arena is copied once, at submit()."""
    a = np.array([[0.5, 1, 2, 3]], np.float32)
    future = client.submit("sleeper", {"INPUT0": a})
    a[0, 1:] = 9
    np.testing.assert_array_equal(future.result(timeout=30)["OUTPUT0"], [[0.5, 1, 2, 3]])


def test_empty_arrays_return_to_the_arena(main_server, make_client):
    c = make_client(arena_bytes=1 << 20)
    for _ in range(50):  # 50 x 512 KiB through a 1 MiB arena: memory must come back
        a = c.empty((1, 128 * 1024), np.float32)
        a[:] = 1.5
        out = c.infer("identity", [a], copy=True)["OUTPUT0"]
        assert out.shape == (1, 128 * 1024) and (out == 1.5).all()
        del a
        gc.collect()
    with pytest.raises(TypeError):
        c.empty((2,), object)


def _fill_arena_until_busy(c, n_max=64):
    held = []
    for i in range(n_max):
        x = np.full((1, 2048), i, np.float32)
        try:
            held.append((i, c.infer("identity", [x])))
        except errors.BusyError as e:
            assert "arena" in str(e)
            return held
    pytest.fail(f"{n_max} held results never filled a small arena: outputs are not views")


def test_output_views_lifetime(main_server, make_client):
    c = make_client(arena_bytes=64 << 10)
    # A view stays valid (its memory is not reused) while referenced, even after
    # the InferResult itself is gone.
    first = c.infer("identity", [np.full((1, 2048), -1.0, np.float32)])["OUTPUT0"]
    for i in range(40):
        c.infer("identity", [np.full((1, 2048), i, np.float32)])
    assert (first == -1.0).all()
    del first

    # Held results pin arena memory until the arena is full...
    held = _fill_arena_until_busy(c)
    assert held
    for i, r in held:
        assert (r["OUTPUT0"] == i).all()
    # ...release() gives it back at once,
    held[0][1].release()
    assert len(held[0][1]) == 0
    assert (c.infer("identity", [np.ones((1, 2048), np.float32)])["OUTPUT0"] == 1).all()
    for _, r in held[1:]:
        r.release()

    # ...so does leaving a with-block, even if the result object is kept,
    kept = []
    for i in range(40):
        with c.infer("identity", [np.full((1, 2048), i, np.float32)]) as r:
            assert (r["OUTPUT0"] == i).all()
        kept.append(r)
    # ...and copy=True never holds arena memory.
    copies = [c.infer("identity", [np.full((1, 2048), i, np.float32)], copy=True)
              for i in range(40)]
    for i, r in enumerate(copies):
        assert (r["OUTPUT0"] == i).all() and r["OUTPUT0"].flags.owndata


def test_views_survive_client_close(main_server, make_client):
    c = make_client(arena_bytes=1 << 20)
    x = np.arange(100, dtype=np.float32)[None]
    r = c.infer("identity", [x])
    e = c.empty((3,), np.int64)
    e[:] = 5
    c.close()
    np.testing.assert_array_equal(r["OUTPUT0"], x)
    assert (e == 5).all()
    with pytest.raises(errors.ServerDeadError):
        c.infer("identity", [x])


def test_submit_many_in_flight(client):
    rng = np.random.default_rng(3)
    work = []
    for i in range(300):  # far more than the lease's slots
        x = rng.integers(-2**31, 2**31, (1 + i % 5, 9), dtype=np.int64).astype(np.int32)
        model = "id_INT32" if i % 2 else "simple"
        inputs = {"INPUT0": x} if model == "id_INT32" else \
            {"INPUT0": x[:, :1].repeat(16, 1)[:4], "INPUT1": np.ones((min(len(x), 4), 16), np.int32)}
        work.append((model, inputs, client.submit(model, inputs)))
    for model, inputs, f in work:
        out = f.result(timeout=60)
        if model == "id_INT32":
            np.testing.assert_array_equal(out["OUTPUT0"], inputs["INPUT0"])
        else:
            np.testing.assert_array_equal(out["OUTPUT0"], inputs["INPUT0"] + 1)


def test_infer_async(client):
    async def main():
        xs = [np.full((1, 3 + i), i, np.float64) for i in range(40)]
        outs = await asyncio.gather(*(client.infer_async("id_FP64", {"INPUT0": x}) for x in xs))
        for x, out in zip(xs, outs):
            np.testing.assert_array_equal(out["OUTPUT0"], x)
        with pytest.raises(errors.ModelNotFoundError):
            await client.infer_async("no_such_model", {"INPUT0": xs[0]})

    asyncio.run(main())


def test_output_too_small_is_retried_transparently(client):
    """grow's output is 3x its input; the client's first guess (input size) is too
    small and the request is resent with the size the server reported."""
    for n in (10, 5000):
        x = np.arange(2 * n, dtype=np.float32).reshape(2, n)
        out = client.infer("grow", [x])["OUTPUT0"]
        np.testing.assert_array_equal(out, np.concatenate([x, x, x], axis=1))


def test_versions(client):
    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    latest = client.infer("versioned", [x])
    assert latest.model_version == 2
    np.testing.assert_array_equal(latest["OUTPUT0"], x + 2)
    v1 = client.infer("versioned", [x], version=1)
    assert v1.model_version == 1
    np.testing.assert_array_equal(v1["OUTPUT0"], x + 1)
    assert client.model_metadata("versioned", version=1)["version"] == 1
    assert client.model_metadata("versioned")["version"] == 2


def test_metadata_config_models_statistics(client):
    meta = client.model_metadata("simple")
    assert meta["name"] == "simple" and meta["version"] == 1
    assert meta["platform"] == "python" and meta["max_batch_size"] == 8
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
                              {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]},
                               {"name": "OUTPUT1", "datatype": "INT32", "shape": [-1, 16]}]
    assert client.model_metadata("mlp")["platform"] == "onnxruntime"

    cfg = text_format.Parse(client.model_config("mlp"), mc.ModelConfig())
    assert cfg.name == "mlp" and cfg.max_batch_size == 64
    assert [i.name for i in cfg.input] == ["INPUT0"] and list(cfg.input[0].dims) == [256]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 200

    models = {(m["name"], m["version"]): m for m in client.models()}
    for name in ("identity", "simple", "mlp", "sleeper", "id_FP32"):
        assert models[(name, 1)]["state"] == "READY"
    assert models[("versioned", 2)]["state"] == "READY"
    assert models[("broken", 1)]["state"].startswith("UNAVAILABLE")
    assert "cannot load weights" in models[("broken", 1)]["state"]

    def stats():
        (row,) = client.statistics("simple")
        return row

    before = stats()
    a = np.ones((3, 16), np.int32)
    for _ in range(5):
        client.infer("simple", [a, a])
    after = stats()
    assert after["name"] == "simple" and after["version"] == "1"
    ok, failed = (after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
                  for k in ("success", "fail"))
    assert ok == 5 and failed == 0
    assert after["inference_count"] - before["inference_count"] == 15
    assert after["execution_count"] - before["execution_count"] >= 1
    assert sum(after["shmserve"]["batch_requests"].values()) == after["execution_count"]
    assert {s["name"] for s in client.statistics()} >= {"identity", "simple", "mlp"}


def test_timestamps_are_ordered(client):
    r = client.infer("identity", [np.ones((1, 4), np.float32)])
    t = r.timestamps_ns
    assert len(t) == 8 and all(v > 0 for v in t)
    assert list(t) == sorted(t), t


def test_client_finds_server_through_runtime_dir_env(main_server):
    # SHMSERVE_RUNTIME_DIR is set by the fixture; no socket path given here.
    with shmserve.Client(main_server.name, arena_bytes=1 << 20) as c:
        assert c.infer("identity", [np.ones((1, 2), np.float32)], copy=True)["OUTPUT0"].sum() == 2
