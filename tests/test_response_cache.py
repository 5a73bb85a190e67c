"""Issue 11: Triton's response cache (response_cache { enable: true } with
--cache-config local,size=BYTES), shmserve/server/response_cache.py."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from helpers import IDENTITY_CODE, python_config, wait_until, write_model
from test_metrics import free_port, scrape
from shmserve.errors import ConfigError
from shmserve.server.repository import load_model
from shmserve.server.response_cache import ResponseCache, parse_cache_config

pytestmark = pytest.mark.timeout(120)

# Two outputs, and a sleep *before* it reads its input: a caller rewriting its input
# in its arena during the sleep would change what an uncopied input reads.
TWO_OUTPUTS_CODE = '''
import time

class TritonPythonModel:
    def execute(self, inputs):
        time.sleep(0.3 if inputs["INPUT0"].shape[1] == 3 else 0)
        x = inputs["INPUT0"]
        return {"OUTPUT0": x * 2, "OUTPUT1": x + 1}
'''
CACHED = "\n".join([
    'name: "cached"', 'backend: "python"', "max_batch_size: 8",
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]',
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },',
    '         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] } ]',
    "dynamic_batching { max_queue_delay_microseconds: 100000 }",
    "response_cache { enable: true }"]) + "\n"
CACHE_ARGS = ["--cache-config", "local,size=1048576"]


def stats(client, model="cached") -> dict:
    (s,) = client.statistics(model)
    inf = s["inference_stats"]
    return {"executed": s["inference_count"], "hits": inf["cache_hit"]["count"],
            "misses": inf["cache_miss"]["count"], "success": inf["success"]["count"]}


def cached_server(server_factory, args=CACHE_ARGS):
    return server_factory(models=(), args=args, setup=lambda repo: write_model(
        repo, "cached", CACHED, TWO_OUTPUTS_CODE))


def x(*values) -> np.ndarray:
    return np.array([values], np.float32)


def test_cache_config_parsed_as_triton():
    assert parse_cache_config([]) == 0
    assert parse_cache_config(["local,size=1048576"]) == 1 << 20
    with pytest.raises(ConfigError, match="'redis' cache is not implemented"):
        parse_cache_config(["redis,host=localhost"])
    with pytest.raises(ConfigError, match="takes size=BYTES only, not 'bytes'"):
        parse_cache_config(["local,bytes=5"])
    with pytest.raises(ConfigError, match="size must be a whole number"):
        parse_cache_config(["local,size=1MB"])
    with pytest.raises(ConfigError, match="expected NAME,KEY=VALUE"):
        parse_cache_config(["local"])


def test_least_recently_used_entry_goes_first():
    cache = ResponseCache(3 * 16, "m", 1)  # three entries of 16 bytes
    keys = [cache.key([("INPUT0", np.full((1, 4), i, np.float32))], None) for i in range(4)]
    assert len(set(keys)) == 4
    for k in keys[:3]:
        assert cache.put(k, {"OUTPUT0": np.zeros(4, np.float32)})
    assert cache.get(keys[0]) is not None  # now the most recently used
    cache.put(keys[3], {"OUTPUT0": np.zeros(4, np.float32)})
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    assert cache.evictions == 1 and cache.bytes == 48
    assert not cache.put(b"big", {"OUTPUT0": np.zeros(13, np.float32)})  # over the budget


def test_key_names_model_inputs_shapes_and_parameters():
    a, b = ResponseCache(1 << 20, "m", 1), ResponseCache(1 << 20, "m", 2)
    one = [("INPUT0", np.ones((1, 4), np.float32))]
    assert a.key(one, None) != b.key(one, None)  # another version
    assert a.key(one, None) != a.key([("INPUT0", np.ones((2, 2), np.float32))], None)
    assert a.key(one, None) != a.key([("INPUT0", np.ones((1, 4), np.int32))], None)
    assert a.key(one, None) != a.key(one, {"k": 1})
    strings = np.array([[b"ab", b"c"]], object)
    assert a.key([("S", strings)], None) != a.key([("S", np.array([[b"a", b"bc"]], object))], None)


def test_identical_requests_are_answered_from_the_cache(server_factory):
    server = cached_server(server_factory)
    c = server.client(arena_bytes=1 << 20)
    first = c.infer("cached", [x(1, 2)])
    np.testing.assert_array_equal(first["OUTPUT0"], x(2, 4))
    second = c.infer("cached", [x(1, 2)])
    np.testing.assert_array_equal(second["OUTPUT0"], x(2, 4))
    np.testing.assert_array_equal(second["OUTPUT1"], x(2, 3))
    assert stats(c) == {"executed": 1, "hits": 1, "misses": 1, "success": 2}
    c.infer("cached", [x(1, 2, 3, 4)])  # other shape, other request
    assert stats(c)["executed"] == 2
    (s,) = c.statistics("cached")
    assert s["execution_count"] == 2  # Triton: cached requests are not executions
    assert s["inference_stats"]["cache_hit"]["ns"] > 0


def test_requested_outputs_come_from_the_whole_kept_response(server_factory):
    server = cached_server(server_factory)
    c = server.client(arena_bytes=1 << 20)
    only0 = c.infer("cached", [x(5, 6)], outputs=["OUTPUT0"])
    assert list(only0) == ["OUTPUT0"]
    only1 = c.infer("cached", [x(5, 6)], outputs=["OUTPUT1"])
    np.testing.assert_array_equal(only1["OUTPUT1"], x(6, 7))
    assert stats(c)["hits"] == 1


def test_a_batch_runs_its_misses_only(server_factory):
    server = cached_server(server_factory)
    c = server.client(arena_bytes=1 << 20)
    c.infer("cached", [x(1, 1)])
    c.infer("cached", [x(2, 2)])
    # one batch (the queue delay holds them): two hits, two misses
    futures = [c.submit("cached", [x(v, v)]) for v in (1, 3, 2, 4)]
    for v, f in zip((1, 3, 2, 4), futures):
        np.testing.assert_array_equal(f.result(30)["OUTPUT0"], x(2 * v, 2 * v))
    assert stats(c) == {"executed": 4, "hits": 2, "misses": 4, "success": 6}
    (s,) = c.statistics("cached")
    assert s["shmserve"]["batch_requests"].get("2") == 1, s["shmserve"]["batch_requests"]


def test_what_is_hashed_is_what_the_model_read(server_factory):
    """A caller that rewrites its input in its arena while the model runs cannot make
    the key of one input name the outputs of another (the worker hashes and runs one
    private copy)."""
    server = cached_server(server_factory)
    c = server.client(arena_bytes=1 << 20)
    a = c.empty((1, 3), np.float32)  # lives in the arena: sent without a copy
    a[:] = 1
    future = c.submit("cached", {"INPUT0": a})
    wait_until(lambda: stats(c)["misses"] == 1, 10, "the request to be looked up")
    a[:] = 5  # the model sleeps 0.3 s before it reads its input
    np.testing.assert_array_equal(future.result(30)["OUTPUT0"], x(2, 2, 2))
    np.testing.assert_array_equal(c.infer("cached", [x(5, 5, 5)])["OUTPUT0"], x(10, 10, 10))
    np.testing.assert_array_equal(c.infer("cached", [x(1, 1, 1)])["OUTPUT0"], x(2, 2, 2))
    assert stats(c) == {"executed": 2, "hits": 1, "misses": 2, "success": 3}


def test_errors_are_not_kept(server_factory):
    raiser = '''
class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        if (x < 0).any():
            raise ValueError("negative input")
        return {"OUTPUT0": x}
'''
    server = server_factory(models=(), args=CACHE_ARGS, setup=lambda repo: write_model(
        repo, "picky", python_config("picky", extra="response_cache { enable: true }"), raiser))
    c = server.client(arena_bytes=1 << 20)
    for _ in range(2):
        with pytest.raises(Exception, match="negative input"):
            c.infer("picky", [x(-1)])
    (s,) = c.statistics("picky")
    assert s["inference_stats"]["cache_hit"]["count"] == 0
    assert s["inference_stats"]["fail"]["count"] == 2


def test_without_a_server_cache_the_model_executes_and_says_so(server_factory):
    server = cached_server(server_factory, args=[])
    c = server.client(arena_bytes=1 << 20)
    for _ in range(2):
        c.infer("cached", [x(1, 2)])
    assert stats(c) == {"executed": 2, "hits": 0, "misses": 0, "success": 2}
    assert ("model 'cached': response_cache is enabled but the server has no cache "
            "(--cache-config local,size=BYTES)") in server.log(10**6)


def test_cache_metrics_as_triton(server_factory):
    port = free_port()
    server = server_factory(models=(), args=CACHE_ARGS + ["--metrics-port", str(port)],
                            setup=lambda repo: write_model(repo, "cached", CACHED, TWO_OUTPUTS_CODE))
    c = server.client(arena_bytes=1 << 20)
    for _ in range(3):
        c.infer("cached", [x(7)])
    _, text = scrape(port)
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 2' in text, text
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 1' in text, text
    assert "nv_cache_hit_duration_per_model" in text and "nv_cache_miss_duration_per_model" in text


@pytest.mark.parametrize("extra, why", [
    ("sequence_batching { }", "not applied to a model with sequence_batching"),
])
def test_cache_on_a_stateful_model_is_warned_and_off(tmp_path, caplog, extra, why):
    write_model(tmp_path, "m", python_config("m", dynamic_batching=None,
                                             extra=f"response_cache {{ enable: true }}\n{extra}"),
                IDENTITY_CODE)
    with caplog.at_level(logging.WARNING, logger="shmserve.repository"):
        (spec,) = load_model(tmp_path / "m")
    assert not spec.response_cache
    assert any(why in r.getMessage() for r in caplog.records), caplog.text


def test_serve_refuses_an_unknown_cache(server_factory):
    server = server_factory(models=("identity",), args=["--cache-config", "redis,port=6379"],
                            start=False)
    with pytest.raises(Exception):
        server.start(timeout=30)
    deadline = time.monotonic() + 10
    while server.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "the 'redis' cache is not implemented by shmserve" in server.log(10**6)
