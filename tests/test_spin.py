"""The spin policy (shms_spin in shms_wait.h) as the batcher and workers run it through
doorbell_wait(..., AdaptiveSpin, ...): it learns from waits, and a spin preempted by
another process on the same CPU turns spinning off for SHMS_SPIN_BACKOFF_WAITS waits."""
from __future__ import annotations

import mmap
import os

import pytest

from helpers import cpu_bound_process
from shmserve import _core

pytestmark = pytest.mark.timeout(60)

BACKOFF_WAITS = 256  # SHMS_SPIN_BACKOFF_WAITS


def test_waits_feed_the_policy():
    ops = _core.Mapping(mmap.mmap(-1, 4096))
    spin = _core.AdaptiveSpin(50_000, 200_000)
    assert (spin.budget_ns(), spin.backoff, spin.preempted) == (75_000, 0, 0)  # 1.5 x typical
    ops.store32(0, 1)  # the word already moved: no wait at all
    for _ in range(64):
        assert ops.doorbell_wait(0, 4, 0, spin, 1_000_000) == 1  # Wake.SPIN
    assert spin.typical_ns < 50_000  # short waits: the base spin stays the budget
    assert spin.budget_ns() == 50_000
    assert ops.doorbell_wait(0, 4, 1, 0, 0) == 0  # a plain spin in ns still works
    with pytest.raises(TypeError):
        ops.doorbell_wait(0, 4, 1, "spin", 0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_preempted_spin_backs_off_then_probes_again():
    """The waiter and a CPU-bound process share one CPU: the waiter's first yield hands
    the CPU over for a scheduler slice, the spin stops there and the waiter sleeps; the
    next BACKOFF_WAITS waits do not spin, the one after spins again."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = cpu_bound_process()
    ops = _core.Mapping(mmap.mmap(-1, 4096))
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        # a yield may come back early (the neighbour migrating, another process's short
        # turn on a loaded machine): that ends the spin without losing a slice
        for _ in range(10):
            spin = _core.AdaptiveSpin(2_000_000_000, 2_000_000_000)  # would spin 2 s
            # nobody rings: it times out after 300 ms, having slept most of them
            assert ops.doorbell_wait(0, 4, 0, spin, 300_000_000) == 0
            if spin.preempted:
                break
    finally:
        os.sched_setaffinity(0, before)
        busy.kill()
        busy.communicate()
    assert (spin.preempted, spin.backoff, spin.budget_ns()) == (1, BACKOFF_WAITS, 0)
    for left in range(BACKOFF_WAITS - 1, -1, -1):
        assert ops.doorbell_wait(0, 4, 0, spin, 0) == 0
        assert spin.backoff == left
    assert spin.budget_ns() == 2_000_000_000


def test_a_callers_preempted_spin_backs_off_too(server_factory):
    """A caller's wait in the one-C-call path (client_call.c) learns as the server's
    waiters do: the caller shares its CPU with a CPU-bound process, its spin's first
    yield is preempted, and the lease's next waits do not spin."""
    import numpy as np

    server = server_factory(args=["--cpu-watch-ms", "0"])  # the policy's own detection alone
    client = server.client(spin_us=2_000_000)  # would spin 2 s for each answer
    core = client.engine._core
    assert core.spin_budget() == 2_000_000_000
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = cpu_bound_process()
    x = np.ones((1, 16), np.float32)
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        # a spin may end before the busy process runs, or with another process's short
        # turn on a loaded machine (a yield kept off the CPU for less than a slice)
        for _ in range(20):
            np.testing.assert_array_equal(client.infer("identity", [x], copy=True)["OUTPUT0"], x)
            if core.spin_budget() == 0:
                break
    finally:
        os.sched_setaffinity(0, before)
        busy.kill()
        busy.communicate()
    assert core.spin_budget() == 0
