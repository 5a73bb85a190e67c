"""shmserve_bench.contention.BusyLoad: busy processes that always go away."""
import os

import pytest

from shmserve_bench import proctree
from shmserve_bench.contention import BusyLoad


def _alive(pids):
    table = proctree.processes()
    return [p for p in pids if p in table and table[p].state != "Z"]


@pytest.mark.timeout(60)
def test_busy_processes_run_and_are_stopped_even_on_error():
    with pytest.raises(RuntimeError, match="measurement failed"):
        with BusyLoad(2) as busy:
            pids = busy.pids()
            assert len(pids) == 2 and _alive(pids) == pids
            assert all(proctree.processes()[p].ppid == os.getpid() for p in pids)
            raise RuntimeError("measurement failed")
    assert _alive(pids) == [] and busy.pids() == []


def test_default_is_one_per_usable_core():
    assert BusyLoad().count == len(os.sched_getaffinity(0))
