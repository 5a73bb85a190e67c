"""Many callers at once: separate processes, threads sharing a client, futures."""
from __future__ import annotations

import concurrent.futures
import multiprocessing

import helpers
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)


def batch_histogram(client, model):
    (row,) = client.statistics(model)
    return {int(k): v for k, v in row["shmserve"]["batch_requests"].items()}


def test_eight_client_processes(main_server, client):
    """8 processes, each with its own lease and data, checking its own answers;
    meanwhile the slow model (2 ms per execution) batches their requests."""
    before = batch_histogram(client, "slow")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as pool:
        jobs = pool.starmap_async(helpers.busy_client,
                                  [(str(main_server.socket_path), main_server.name, i, 40)
                                   for i in range(8)])
        outcomes = jobs.get(timeout=80)
    assert outcomes == [""] * 8, [o for o in outcomes if o]
    after = batch_histogram(client, "slow")
    grew = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    assert sum(n * k for n, k in grew.items()) == 8 * 40  # every request executed once
    assert any(n > 1 and k > 0 for n, k in grew.items()), grew


def test_dynamic_batching_forms_batches(client):
    """Requests queued behind a busy instance go out together."""
    before = batch_histogram(client, "slow")
    xs = [np.full((1, 5), i, np.float32) for i in range(48)]
    futures = [client.submit("slow", [x]) for x in xs]
    for x, f in zip(xs, futures):
        np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], x)
    after = batch_histogram(client, "slow")
    grew = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    assert sum(n * k for n, k in grew.items()) == 48
    assert max(n for n, k in grew.items() if k) > 1, grew


def test_threads_share_one_client(client):
    def work(t):
        rng = np.random.default_rng(t)
        for i in range(40):
            x = rng.integers(0, 2**62, (1 + (i + t) % 4, 11), dtype=np.int64)
            out = client.infer("id_INT64", {"INPUT0": x})
            np.testing.assert_array_equal(out["OUTPUT0"], x)
            f = client.submit("id_INT64", {"INPUT0": x + 1})
            np.testing.assert_array_equal(f.result(timeout=30)["OUTPUT0"], x + 1)
        return t

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(work, range(8))) == list(range(8))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_submit_under_arena_pressure(main_server):
    """More requests in flight than the arena holds: submit() waits for completions
    to make room, and every future gets its own answer."""
    import shmserve

    c = shmserve.Client(main_server.name, socket_path_=str(main_server.socket_path),
                        arena_bytes=256 << 10)
    try:
        futures = []
        for i in range(1500):
            futures.append((i, c.submit("identity", [np.full((1, 4096), i, np.float32)],
                                        copy=True)))
        _, pending = concurrent.futures.wait([f for _, f in futures], timeout=30)
        assert not pending, f"{len(pending)} futures never resolved"
        for i, f in futures:
            out = f.result()["OUTPUT0"]
            assert out.shape == (1, 4096) and (out == i).all(), i
    finally:
        try:
            c.close()
        except Exception:
            pass
