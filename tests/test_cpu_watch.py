"""The coordinator's CPU watch (shmserve/server/cpu_watch.py) and the `crowded` word
every waiter's spin policy reads (shms_spin.crowded in shms_wait.h): while other work
leaves no CPU idle, nobody spins; when it goes, spinning comes back."""
from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from shmserve import _core
from shmserve.protocol import LAYOUT as L
from shmserve.server.cpu_watch import CpuWatch, ProcessClock, busy_cpu_seconds, watch
from shmserve.server.placement import Placement
from shmserve.status import StatusSource

from helpers import cpu_bound_process, wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_raised_word_stops_the_spin_and_a_lowered_one_restores_it():
    ops = _core.Mapping(mmap.mmap(-1, 4096))
    spin = _core.AdaptiveSpin(50_000, 200_000)
    spin.watch(ops, 64)
    assert spin.budget_ns() == 75_000
    ops.store32(64, 1)
    assert spin.budget_ns() == 0
    ops.store32(64, 0)  # the base again
    assert spin.budget_ns() == 75_000
    with pytest.raises(IndexError):
        spin.watch(ops, 4096)  # outside the mapping
    with pytest.raises(TypeError):
        spin.watch(b"not a mapping", 0)


def test_a_watched_mapping_outlives_its_release_until_the_spin_goes():
    """release() while a spin watches the mapping is deferred: the policy never reads
    unmapped memory; the last watcher's end lets the release happen."""
    ops = _core.Mapping(mmap.mmap(-1, 4096))
    spin = _core.AdaptiveSpin(50_000, 200_000)
    spin.watch(ops, 0)
    ops.store32(0, 1)
    ops.release()
    assert spin.budget_ns() == 0  # still reads the (still mapped) word
    del spin


def test_the_judgement_has_hysteresis_and_one_cpu_spins_when_quiet():
    watch = CpuWatch(cpus=2)
    # other work took 0.2 of 2 CPUs over 1 s: 1.8 free, no change
    assert not watch.judge(busy_s=1.0, ours_s=0.8, wall_s=1.0) and not watch.crowded
    # 1.2 CPUs of other work: 0.8 free < 1.5
    assert watch.judge(busy_s=2.0, ours_s=0.8, wall_s=1.0) and watch.crowded
    # 1.6 free: not yet 1.5 + 0.25, stays crowded
    assert not watch.judge(busy_s=1.2, ours_s=0.8, wall_s=1.0) and watch.crowded
    assert watch.judge(busy_s=0.9, ours_s=0.8, wall_s=1.0) and not watch.crowded
    assert watch.changes == 2 and watch.status()["free_cpus"] == 1.9
    # our own processes may use every CPU: that is never other work
    assert not watch.judge(busy_s=2.0, ours_s=2.0, wall_s=1.0) and not watch.crowded
    # one CPU: quiet, it spins as before (0.5 needed); a busy neighbour crowds it
    one = CpuWatch(cpus=1)
    one.judge(busy_s=0.3, ours_s=0.25, wall_s=1.0)
    assert not one.crowded
    one.judge(busy_s=1.0, ours_s=0.2, wall_s=1.0)
    assert one.crowded


def test_the_clocks_count_busy_time_and_skip_the_unknown():
    before = busy_cpu_seconds(os.sched_getaffinity(0))
    clock = ProcessClock()
    assert clock.spent([2**22 + 7]) == 0.0  # no such pid
    # running before it was first seen: its share of this interval is unknown
    assert clock.spent([os.getpid(), 2**22 + 7]) is None
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert clock.spent([os.getpid(), 2**22 + 7]) >= 0.03  # ticks: 10 ms resolution
    assert busy_cpu_seconds(os.sched_getaffinity(0)) - before >= 0.03
    # born within the interval: all of its CPU time counts in it
    time.sleep(0.05)  # start times have the clock tick's resolution
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.1\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while psutil.Process(child.pid).cpu_times().user < 0.1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert clock.spent([os.getpid(), child.pid]) >= 0.08
    finally:
        child.kill()
        child.wait()


def test_the_watch_rests_while_no_client_is_connected():
    """No client: a raised word is lowered and nothing is measured; a client connects:
    the first interval starts, and the next is judged."""
    state = CpuWatch(cpus=2, crowded=True, free_cpus=0.4)
    published, connected, measured = [], [False], []

    def our_pids():
        measured.append(connected[0])
        return [os.getpid()]

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(watch(state, 0.01, our_pids, published.append,
                                         stop, lambda: connected[0]))
        await asyncio.sleep(0.1)
        assert not measured  # resting: no process was read
        resting = state.status()
        connected[0] = True
        for _ in range(500):
            await asyncio.sleep(0.01)
            if state.free_cpus is not None:
                break
        stop.set()
        await task
        return resting

    resting = asyncio.run(run())
    assert published[0] is False and (resting["crowded"], resting["free_cpus"]) == (False, None)
    assert resting["resting"] and resting["changes"] == 1
    assert not state.resting and state.free_cpus is not None


def test_the_server_watches_only_while_clients_are_connected(server_factory):
    server = server_factory(args=["--cpu-watch-ms", "20"])
    viewer = StatusSource(server.name, 10)  # a bare control connection, not a client
    watching = lambda: viewer.fetch()["cpu_watch"]  # noqa: E731
    try:
        wait_until(lambda: watching()["resting"], 30, "the watch to rest", state=watching)
        client = server.client()
        wait_until(lambda: watching()["free_cpus"] is not None, 30,
                   "the watch to judge an interval", state=watching)
        assert not watching()["resting"]
        client.close()
        wait_until(lambda: watching()["resting"], 30, "the watch to rest again", state=watching)
        assert watching()["free_cpus"] is None
    finally:
        viewer.close()


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [cpu_bound_process() for _ in range(n)]


def test_the_server_stops_spinning_while_other_work_takes_the_cpus(server_factory):
    """CPU-bound processes, one per CPU: the coordinator raises `crowded` in the control
    block (clients) and the server header (its own waiters), the client's policy stops
    spinning and the answers stay right; when they end, spinning comes back."""
    server = server_factory(args=["--cpu-watch-ms", "50"])
    client = server.client()
    core, ctl = client.engine._core, client.engine._ctl
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    watch = lambda: client.server_status()["cpu_watch"]  # noqa: E731
    assert watch()["interval_ms"] == 50 and watch()["cpus"] == len(os.sched_getaffinity(0))
    busy = busy_processes(len(os.sched_getaffinity(0)))
    try:
        wait_until(lambda: watch()["crowded"], 60, "the watch to see the CPUs crowded",
                   state=watch)
        assert ctl.load32(L["control.crowded"]) == 1
        assert core.spin_budget() == 0
        for _ in range(20):
            np.testing.assert_array_equal(client.infer("identity", [x], copy=True)["OUTPUT0"], x)
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.communicate()
    wait_until(lambda: not watch()["crowded"], 60, "the watch to see the CPUs free again",
               state=watch)
    assert ctl.load32(L["control.crowded"]) == 0 and core.spin_budget() > 0
    assert watch()["changes"] >= 2


def test_a_server_that_does_not_watch_never_raises_the_word(server_factory):
    server = server_factory(args=["--cpu-watch-ms", "0"])
    client = server.client()
    busy = busy_processes(len(os.sched_getaffinity(0)))
    try:
        time.sleep(0.5)  # several intervals of a watch, were there one
        status = client.server_status()["cpu_watch"]
        assert (status["crowded"], status["free_cpus"], status["interval_ms"]) == (False, None, 0)
        assert client.engine._ctl.load32(L["control.crowded"]) == 0
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.communicate()


# -- placement.py: crowded, the server runs where its callers run ---------------------

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="colocation needs at least 2 CPUs to choose from")


def server_processes(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.pid).children()
            if any(m in p.cmdline() for m in ("shmserve.server.batcher", "shmserve.server.worker"))]


def affinities(procs: list[psutil.Process]) -> set[frozenset]:
    """The affinity of every thread of these processes."""
    return {frozenset(os.sched_getaffinity(t.id)) for p in procs for t in p.threads()}


@needs_two_cpus
def test_placement_finds_the_cpu_its_callers_ran_on():
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    busy = cpu_bound_process()  # pinned below: its CPU time is all on `cpu`
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        placement = Placement(allowed)
        assert placement.caller_cpu([busy.pid]) is None  # a first look has nothing to compare
        time.sleep(0.2)
        assert placement.caller_cpu([busy.pid]) == cpu
        assert placement.caller_cpu([999_999_999]) is None  # gone: no CPU, no error
    finally:
        busy.kill()
        busy.communicate()


@needs_two_cpus
@pytest.mark.parametrize("colocate", [True, False])
def test_a_crowded_server_runs_on_its_callers_cpu_then_everywhere_again(server_factory, colocate):
    """Busy processes on every CPU and a caller on one: the batcher and the workers are
    pinned there (every thread) while crowded, and get every CPU back after; with
    --colocate-when-crowded false they are never moved."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    server = server_factory(args=["--cpu-watch-ms", "50",
                                  "--colocate-when-crowded", str(colocate).lower()])
    client = server.client()
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    watch = lambda: client.server_status()["cpu_watch"]  # noqa: E731
    procs = server_processes(server)
    assert procs and affinities(procs) == {frozenset(allowed)}
    busy = busy_processes(len(allowed))
    os.sched_setaffinity(0, {cpu})  # this test's thread is the caller
    try:
        def calling(check):
            def step():
                for _ in range(50):
                    np.testing.assert_array_equal(client.infer("identity", [x], copy=True)["OUTPUT0"], x)
                return check()
            return step
        wait_until(calling(lambda: watch()["crowded"]), 60, "the watch to see the CPUs crowded",
                   state=watch)
        if colocate:
            wait_until(calling(lambda: watch()["home_cpu"] == cpu
                               and affinities(procs) == {frozenset({cpu})}), 60,
                       f"the server's threads pinned to CPU {cpu}", state=watch)
        else:
            calling(lambda: None)()
            time.sleep(0.3)  # several intervals of the watch
            assert watch()["home_cpu"] is None and affinities(procs) == {frozenset(allowed)}
    finally:
        os.sched_setaffinity(0, allowed)
        for p in busy:
            p.kill()
        for p in busy:
            p.communicate()
    wait_until(lambda: not watch()["crowded"] and watch()["home_cpu"] is None, 60,
               "the watch to see the CPUs free again", state=watch)
    assert affinities(procs) == {frozenset(allowed)}
