"""CPU contention for a benchmark: CPU-bound processes that compete with the server
and its clients for every core.

    with BusyLoad() as busy:          # one `while True: pass` process per core
        ...                            # measure under contention
    # stopped (SIGKILL, reaped) on the way out, whatever happened in the block

Each busy process also gets SIGKILL from the kernel should the process that started
it die first (PR_SET_PDEATHSIG), so that none outlives an interrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from .harness import with_parent_death


class BusyLoad:
    """`count` CPU-bound processes (default: one per usable core), at normal priority;
    in the starter's session, or with `own_session` in one of their own (a neighbour
    service: under autogroup, its own scheduling group)."""

    def __init__(self, count: int | None = None, own_session: bool = False):
        self.count = count if count is not None else len(os.sched_getaffinity(0))
        self.own_session = own_session
        self.procs: list[subprocess.Popen] = []

    def start(self) -> BusyLoad:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(
                with_parent_death([sys.executable, "-c", "while True: pass"], signal.SIGKILL),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=self.own_session))
        return self

    def stop(self) -> None:
        """SIGKILL each (by its pid) and reap it."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> BusyLoad:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
