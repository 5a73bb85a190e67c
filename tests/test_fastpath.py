"""The Python client's two paths (client/engine.py): the C path (csrc/client.c) takes
the common request in one call; everything else falls back to the Python path, which
keeps its behaviour and messages. Engine.counters says which path sent what."""
from __future__ import annotations

import concurrent.futures
import gc

import helpers
import numpy as np
import pytest

from shmserve import errors

pytestmark = pytest.mark.timeout(90)


def sent(client) -> tuple[int, int]:
    """(requests the C path took a slot for, the Python path did) so far."""
    c = client.engine.counters
    return c["c"], c["python"]


def test_common_requests_take_the_c_path(client):
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    v = np.arange(8, dtype=np.int32).reshape(2, 4)
    requests = [
        ("identity", {"INPUT0": x}, {}),
        ("identity", [x], {}),
        ("identity", (x,), {"outputs": "OUTPUT0"}),
        ("simple", {"INPUT1": a, "INPUT0": a}, {"outputs": ["OUTPUT1", "OUTPUT0"]}),
        ("simple", [a, a], {"outputs": ("OUTPUT0",), "copy": True}),
        ("versioned", [v], {"version": 1}),
        ("unbatched", [np.zeros((2, 3), np.int16)], {"timeout": 30}),
        ("id_BOOL", [x > 3], {}),
        ("id_FP16", [x.astype(np.float16)], {}),
        ("id_UINT64", [a.astype(np.ulonglong)], {}),  # numpy's other 64-bit dtype object
    ]
    for model, inputs, kw in requests:
        out = client.infer(model, inputs, **kw)
        assert len(out) and all(isinstance(v, np.ndarray) for v in out.values())
    assert sent(client) == (len(requests), 0)
    np.testing.assert_array_equal(client.infer("identity", [x])["OUTPUT0"], x)
    r = client.infer("simple", {"INPUT0": a, "INPUT1": a}, outputs=["OUTPUT1"], copy=True)
    assert list(r) == ["OUTPUT1"] and r["OUTPUT1"].flags.owndata and not r["OUTPUT1"].any()
    assert client.infer("versioned", [v], version=1).model_version == 1
    stamps = client.infer("identity", [x]).timestamps_ns
    assert len(stamps) == 8 and list(stamps) == sorted(stamps) and stamps[0] > 0
    assert sent(client) == (len(requests) + 4, 0)


def test_unpickled_arrays_take_the_c_path(client):
    """An array that came through pickle (multiprocessing, a queue) has a dtype object
    of its own, equal to numpy's but not the same one: still the common request."""
    import pickle
    x = pickle.loads(pickle.dumps(np.arange(24, dtype=np.float32).reshape(2, 12)))
    assert x.dtype == np.float32 and x.dtype is not np.dtype(np.float32)
    np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    np.testing.assert_array_equal(client.submit("identity", [x]).result(timeout=30)["OUTPUT0"], x)
    assert sent(client) == (2, 0)
    with pytest.raises(errors.InvalidArgumentError, match=">f4"):  # equal values only
        client.infer("identity", [x.astype(">f4")])


def test_outputs_are_views_freed_with_the_last_one(client):
    used = client.engine.counters["arena_used"]
    x = np.full((1, 1000), 2.5, np.float32)
    out = client.infer("identity", [x])["OUTPUT0"]  # the InferResult is gone at once
    assert not out.flags.owndata and client.engine.counters["arena_used"] > used
    gc.collect()
    assert (out == 2.5).all()  # still valid: the view holds its block
    del out
    assert client.engine.counters["arena_used"] == used
    r = client.infer("identity", [x])
    r.release()  # back at once
    assert client.engine.counters["arena_used"] == used
    assert sent(client) == (2, 0)


def test_empty_arrays_are_sent_in_place_by_the_c_path(client):
    a = client.empty((1, 4), np.float32)
    a[:] = [0.5, 1, 2, 3]
    future = client.submit("sleeper", {"INPUT0": a})  # the model reads it after 0.5 s
    a[0, 1:] = 9
    np.testing.assert_array_equal(future.result(timeout=30)["OUTPUT0"], [[0.5, 9, 9, 9]])
    assert sent(client) == (1, 0)


def test_submit_takes_the_c_path(client):
    xs = [np.full((1 + i % 3, 5), i, np.float32) for i in range(40)]  # more than the slots
    futures = [client.submit("slow", [x]) for x in xs]
    for x, f in zip(xs, futures):
        np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], x)
    c, py = sent(client)
    assert c + py == 40 and c >= 32, (c, py)  # the rest waited for a slot in Python


def test_an_idle_poller_is_not_woken_by_synchronous_answers(client):
    """After its last future the poller lingers (POLLER_IDLE_NS) waiting for the next
    submit, not on the arena's completions, which every synchronous answer rings."""
    x = np.ones((1, 4), np.float32)
    client.submit("identity", [x]).result(timeout=30).release()  # the poller lingers now
    engine, collects = client.engine, [0]
    collect = engine._collect

    def counting():
        collects[0] += 1
        return collect()
    engine._collect = counting
    try:
        for _ in range(300):
            client.infer("identity", [x]).release()
        assert collects[0] < 30, f"the idle poller woke {collects[0]} times for 300 answers"
        np.testing.assert_array_equal(  # and a submit wakes it at once
            client.submit("identity", [x]).result(timeout=30)["OUTPUT0"], x)
    finally:
        engine._collect = collect


@pytest.mark.parametrize("case", ["bytes", "non-contiguous", "list values", "dict subclass",
                                  "version as text", "byte-swapped"])
def test_fallbacks_give_the_same_answers(client, case):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    model, inputs, kw, expected = {
        "bytes": ("id_BYTES", [np.array([[b"ab", b""]], object)], {},
                  np.array([[b"ab", b""]], object)),
        "non-contiguous": ("identity", [x[:, ::2]], {}, x[:, ::2]),
        "list values": ("id_FP64", {"INPUT0": [[1.0, 2.5]]}, {}, np.array([[1.0, 2.5]])),
        "dict subclass": ("identity", __import__("collections").OrderedDict(INPUT0=x), {}, x),
        "version as text": ("versioned", [np.ones((1, 4), np.int32)], {"version": "2"},
                            np.full((1, 4), 3, np.int32)),
        "byte-swapped": ("identity", [x.astype(">f4")], {}, None),
    }[case]
    if expected is None:
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"model 'identity' input 'INPUT0': numpy dtype >f4 has no "
                                 r"shmserve data type"):
            client.infer(model, inputs, **kw)
        assert sent(client) == (0, 0)
        return
    out = client.infer(model, inputs, **kw)["OUTPUT0"]
    assert out.tolist() == expected.tolist() and out.dtype == expected.dtype
    assert sent(client) == (0, 1)


def test_errors_of_the_c_path_are_the_python_paths(client):
    a16 = np.ones((1, 16), np.int32)
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' has data type FP32, expected INT32"):
        client.infer("simple", {"INPUT0": a16.astype(np.float32), "INPUT1": a16})
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' dimension 1 is 15, expected 16"):
        client.infer("simple", [np.ones((1, 15), np.int32), a16])
    with pytest.raises(errors.InternalError, match="boom: negative input"):
        client.infer("raiser", [np.array([[1.0, -2.0]], np.float32)])
    assert sent(client) == (3, 0)  # sent by C, the server's answers raised as before
    # Refused before sending: the Python path words the error.
    with pytest.raises(errors.InvalidArgumentError, match=r"'identity'.*'INPUT0'.*complex64"):
        client.infer("identity", {"INPUT0": np.ones((1, 4), np.complex64)})
    with pytest.raises(errors.InvalidArgumentError, match=r"'simple' has no input 'INPUT2'"):
        client.infer("simple", {"INPUT0": a16, "INPUT1": a16, "INPUT2": a16})
    with pytest.raises(errors.InvalidArgumentError, match=r"'simple' has no output 'OUT9'"):
        client.infer("simple", [a16, a16], outputs=["OUT9"])
    with pytest.raises(errors.InvalidArgumentError, match=r"tensor has 9 dimensions \(limit 8\)"):
        client.infer("identity", [np.ones((1,) * 9, np.float32)])
    with pytest.raises(errors.ModelNotFoundError, match="no_such_model"):
        client.infer("no_such_model", [a16])
    assert sent(client) == (3, 1)  # only the 9 dimensions took a slot, given back
    assert client.engine.counters["slots_busy"] == 0


def test_output_too_small_is_resent_by_python(client):
    """grow answers 3x its input: the C path's first guess is too small, the Python
    path resends with the size the server reported; the same with submit()."""
    x = np.arange(2 * 3000, dtype=np.float32).reshape(2, 3000)
    np.testing.assert_array_equal(client.infer("grow", [x])["OUTPUT0"], np.concatenate([x] * 3, 1))
    assert sent(client) == (1, 1)
    f = client.submit("grow", [x])
    np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], np.concatenate([x] * 3, 1))
    assert sent(client) == (2, 2)


def test_timeout_keeps_the_slot_and_block_until_the_answer(client):
    x = np.array([[1.0]], np.float32)  # the sleeper takes 1 s
    with pytest.raises(errors.ServerTimeoutError, match=r"^model 'sleeper': no answer within 0.2 s$"):
        client.infer("sleeper", [x], timeout=0.2)
    assert sent(client) == (1, 0)
    counters = client.engine.counters
    assert counters["slots_busy"] == 1 and counters["arena_used"] > 0  # the orphan's
    # Once the server answered, the orphan's slot and block come back.
    helpers.wait_until(lambda: client.engine._core.reap() == 1, 10, "the orphan to be answered")
    counters = client.engine.counters
    assert counters["slots_busy"] == 0 and counters["arena_used"] == 0
    np.testing.assert_array_equal(client.infer("sleeper", [x * 0], timeout=30)["OUTPUT0"], x * 0)


def test_no_free_slot_waits_in_python(server_factory):
    """Every slot in flight: the C path declines, the Python path waits for a slot."""
    server = server_factory(setup=lambda repo: helpers.write_model(
        repo, "sleeper", helpers.python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
        helpers.SLEEPER_CODE), args=["--slots-per-client", "2"])
    c = server.client(arena_bytes=1 << 20)
    busy = [c.submit("sleeper", [np.array([[1.0]], np.float32)]) for _ in range(2)]
    x = np.ones((1, 8), np.float32)
    np.testing.assert_array_equal(c.infer("identity", [x], timeout=30)["OUTPUT0"], x)
    assert sent(c) == (2, 1)
    for f in busy:
        f.result(timeout=30)
    c.close()


def test_many_threads_share_the_c_path(client):
    def work(t):
        rng = np.random.default_rng(t)
        for i in range(30):
            x = rng.integers(0, 2**62, (1 + (i + t) % 4, 11), dtype=np.int64)
            np.testing.assert_array_equal(client.infer("id_INT64", {"INPUT0": x})["OUTPUT0"], x)
            f = client.submit("id_INT64", [x + 1])
            np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], x + 1)
        return t

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(work, range(8))) == list(range(8))
    c, py = sent(client)
    assert c + py == 8 * 30 * 2 and c > py, (c, py)  # Python only when all slots were busy
    gc.collect()
    assert client.engine.counters["slots_busy"] == 0


def test_closed_client_refuses_both_paths(main_server, make_client):
    c = make_client(arena_bytes=1 << 20)
    x = np.ones((1, 4), np.float32)
    kept = c.infer("identity", [x])
    c.close()
    with pytest.raises(errors.ServerDeadError, match="client is closed"):
        c.infer("identity", [x])
    with pytest.raises(errors.ServerDeadError, match="client is closed"):
        c.submit("identity", [x])
    np.testing.assert_array_equal(kept["OUTPUT0"], x)  # views outlive the lease
