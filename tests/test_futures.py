"""submit()'s futures (client/future.py): concurrent.futures' contract, and cancel()."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import helpers
import numpy as np
import pytest

from shmserve.client.future import ResultFuture

pytestmark = pytest.mark.timeout(60)


# -- the future alone ---------------------------------------------------------------
def test_result_and_callbacks_in_order():
    f, seen = ResultFuture(), []
    f.add_done_callback(lambda g: seen.append(("first", g.result())))
    f.add_done_callback(lambda g: seen.append(("second", g.done())))
    assert not f.done() and not f.running() and not f.cancelled()
    assert f.resolve(7)
    f.add_done_callback(lambda g: seen.append(("late", g.result())))  # runs at once
    assert seen == [("first", 7), ("second", True), ("late", 7)]
    assert f.result() == 7 and f.exception() is None
    assert not f.resolve(8) and f.result() == 7  # a finished future never changes
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(9)
    assert not f.cancel()


def test_failure_is_raised_by_result():
    f = ResultFuture()
    assert f.fail(KeyError("model 'x'"))
    assert isinstance(f.exception(), KeyError)
    with pytest.raises(KeyError, match="model 'x'"):
        f.result()
    assert not f.fail(ValueError())


def test_result_waits_for_another_thread_and_times_out():
    f = ResultFuture()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.05)
    with pytest.raises(concurrent.futures.TimeoutError):
        f.exception(timeout=0.05)
    threading.Timer(0.05, f.resolve, ("late",)).start()
    assert f.result(timeout=10) == "late"


def test_a_raising_callback_is_logged_and_the_others_run(caplog):
    f, seen = ResultFuture(), []
    f.add_done_callback(lambda g: 1 / 0)
    f.add_done_callback(lambda g: seen.append(g.result()))
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        f.resolve(1)
    assert seen == [1] and "exception calling callback" in caplog.text


def test_wait_and_as_completed_see_results_failures_and_cancels():
    futures = [ResultFuture() for _ in range(4)]
    threading.Timer(0.05, futures[0].resolve, (0,)).start()
    threading.Timer(0.05, futures[1].fail, (RuntimeError("no"),)).start()
    threading.Timer(0.05, futures[2].cancel).start()
    done, not_done = concurrent.futures.wait(futures[:3], timeout=10)
    assert done == set(futures[:3]) and not not_done
    done, not_done = concurrent.futures.wait(futures, timeout=0.05)
    assert not_done == {futures[3]}
    first = concurrent.futures.wait(futures, timeout=10,
                                    return_when=concurrent.futures.FIRST_EXCEPTION)
    assert futures[1] in first.done
    threading.Timer(0.05, futures[3].resolve, (3,)).start()
    assert set(concurrent.futures.as_completed(futures, timeout=10)) == set(futures)


def test_cancel_notifies_once_and_drops_a_later_result():
    cancels, seen = [], []
    f = ResultFuture(on_cancel=cancels.append)
    f.add_done_callback(lambda g: seen.append(g.cancelled()))
    assert f.cancel() and f.cancel()  # the second is a no-op that still says True
    assert cancels == [f] and seen == [True] and f.done()
    assert not f.resolve(1) and not f.fail(RuntimeError())
    with pytest.raises(concurrent.futures.CancelledError):
        f.result()
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(1)


def test_asyncio_wraps_it():
    async def main():
        f = ResultFuture()
        threading.Timer(0.05, f.resolve, ("async",)).start()
        assert await asyncio.wrap_future(f) == "async"
        g = ResultFuture()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(g), 0.05)
        return g

    g = asyncio.run(main())
    assert g.cancelled()  # asyncio's cancel reached the request's future


def test_each_future_has_its_own_lock():
    """concurrent.futures.wait() and as_completed() take their futures' locks in id
    order, which rules out a deadlock between two such calls only if each future has
    its own lock: a thread holding one future's must not keep another from taking its."""
    f, g = ResultFuture(), ResultFuture()
    f._condition, g._condition  # made now, as wait() would have made them
    held, release = threading.Event(), threading.Event()

    def hold():
        with f._condition:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    held.wait(10)
    try:
        assert g._condition.acquire(timeout=2), "one future's lock blocks another's"
        g._condition.release()
        threading.Timer(0.05, g.resolve, (1,)).start()
        assert concurrent.futures.wait([g], timeout=10).done == {g}
    finally:
        release.set()
        t.join(10)


# -- with a server: a cancelled request is abandoned, the client goes on -------------
def assert_serving(client):
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    np.testing.assert_array_equal(client.submit("id_FP32", [x]).result(timeout=20)["OUTPUT0"], x)


def test_cancelled_submit_leaves_the_poller_and_the_lease_working(client):
    """Cancelled while the model runs: the caller gets CancelledError, the other
    futures are answered, and the slot and block come back once the server answers."""
    sleeping = client.submit("sleeper", {"INPUT0": np.array([[0.3]], np.float32)})
    helpers.wait_until(lambda: client.engine.counters["slots_busy"] == 1, 10, "the submit")
    assert sleeping.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        sleeping.result()
    assert_serving(client)
    assert client.engine._poller is not None and client.engine._poller.is_alive()
    helpers.wait_until(lambda: client.engine._core.reap() == 1, 10, "the cancelled one's answer")
    counters = client.engine.counters
    assert counters["slots_busy"] == 0 and counters["arena_used"] == 0


def assert_nothing_held(client):
    """Every abandoned request answered and reaped: no slot and no arena byte held."""
    helpers.wait_until(lambda: (client.engine._core.reap() or True)
                       and client.engine.counters["slots_busy"] == 0, 10, "every orphan back")
    assert client.engine.counters["arena_used"] == 0


def test_cancel_racing_the_answer_loses_nothing(client):
    """Cancels landing before, during and after the answers: every future ends either
    answered correctly or cancelled, and the lease ends with nothing held."""
    outcomes = {"answered": 0, "cancelled": 0}
    for round_ in range(20):
        xs = [np.full((1, 4), round_ * 100 + i, np.float32) for i in range(16)]
        futures = [client.submit("id_FP32", [x]) for x in xs]
        for f in futures[round_ % 3::3]:
            f.cancel()
        for x, f in zip(xs, futures):
            try:
                with f.result(timeout=20) as out:
                    np.testing.assert_array_equal(out["OUTPUT0"], x)
                outcomes["answered"] += 1
            except concurrent.futures.CancelledError:
                outcomes["cancelled"] += 1
    assert outcomes["answered"] >= 20 * 10 and outcomes["cancelled"] > 0, outcomes
    assert_nothing_held(client)
    assert_serving(client)


def test_cancel_from_a_callback_between_collect_and_resolve(client):
    """The poller takes a batch's answers out of flight, then resolves them one by one:
    the first callback cancels the others, already collected and not yet resolved.
    Their answers are dropped and their memory comes back; the poller goes on."""
    x = np.ones((1, 8), np.float32)
    for _ in range(5):
        futures = [client.submit("slow", [x]) for _ in range(12)]  # one batch, 2 ms
        seen = []

        def cancel_the_others(f):
            seen.append(f)
            for g in futures:
                if g is not f:
                    g.cancel()

        for f in futures:
            f.add_done_callback(cancel_the_others)
        concurrent.futures.wait(futures, timeout=20)
        assert all(f.done() for f in futures)
        answered = [f for f in futures if not f.cancelled()]
        assert answered and all(np.array_equal(f.result()["OUTPUT0"], x) for f in answered)
        for f in answered:
            f.result().release()
    assert_nothing_held(client)
    assert_serving(client)


def test_cancel_while_the_poller_sends_again(client):
    """grow's output is 3x its input, so the poller sends each request again with
    bigger buffers; cancels from another thread land before, during and after that
    resend. The poller survives, and nothing is held once everything is answered."""
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    stop = threading.Event()
    pending: list = []

    def canceller():
        while not stop.is_set():
            for f in list(pending):
                f.cancel()
            time.sleep(0)

    t = threading.Thread(target=canceller, daemon=True)
    t.start()
    try:
        for _ in range(60):
            f = client.submit("grow", [x])
            pending[:] = [f]
            try:
                np.testing.assert_array_equal(f.result(timeout=20)["OUTPUT0"],
                                              np.concatenate([x] * 3, 1))
                f.result().release()
            except concurrent.futures.CancelledError:
                pass
    finally:
        stop.set()
        t.join(10)
    assert client.engine._poller is not None and client.engine._poller.is_alive()
    assert_nothing_held(client)
    assert_serving(client)


def test_wait_for_timeout_on_infer_async_keeps_the_client_working(client):
    """asyncio.wait_for cancels the request's future when it times out (the case that
    once stopped the futures' poller for good)."""
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.infer_async(
                "sleeper", {"INPUT0": np.array([[0.3]], np.float32)}), 0.05)
        x = np.ones((1, 3), np.float32)
        out = await asyncio.wait_for(client.infer_async("id_FP32", [x]), 20)
        np.testing.assert_array_equal(out["OUTPUT0"], x)

    asyncio.run(main())
