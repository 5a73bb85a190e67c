"""While other work crowds every CPU, the server's processes run where their caller runs.

A round trip is three hand-offs (caller -> batcher -> worker -> caller), each a futex
wake-up. On a crowded machine nobody spins (cpu_watch.py), and a wake-up aimed at
another CPU must interrupt the busy process there (an inter-processor interrupt, on a
virtual machine through the hypervisor): on 2 vCPUs with a CPU-bound process on each,
identity 4 KiB took 62-70 us at p50 and 1.7-3 ms at p99 that way, against 16.6 / 53 us
quiet. A wake-up on the waker's own CPU preempts the busy process at once: with the
caller, the batcher and the workers on one CPU the same run took 16.9 / 60 us
(measured 2026-12-06, alternated, docs/architecture.md "A crowded machine").

So while `crowded` is up, the coordinator looks each interval at which CPU its clients'
threads ran on (weighted by the CPU time each thread used since the last look) and
pins the batcher and the workers to it (`sched_setaffinity`, every thread); when the
machine is free again, they get back every CPU the server may use. The clients are
never touched. This trades throughput for latency on a crowded machine (all of the
server then competes for one CPU), hence `serve --colocate-when-crowded false`.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Iterable

log = logging.getLogger("shmserve.placement")


def threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # gone
        return []


def thread_cpu(pid: int, tid: int) -> tuple[int, int] | None:
    """(CPU the thread last ran on, its CPU time in ns so far), or None if gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            ran_ns = int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return int(fields[36]), ran_ns  # field 39, "processor"


class Placement:
    """Where the server's processes run while the machine is crowded."""

    def __init__(self, allowed: set[int]):
        self.allowed = set(allowed)  # the CPUs the server may use (its own affinity)
        self.home: int | None = None  # the CPU the server is pinned to, None: not pinned
        self.moves = 0  # how often it was pinned somewhere else
        self.last: dict[tuple[int, int], int] = {}  # (pid, tid) -> CPU ns at the last look

    def caller_cpu(self, client_pids: Iterable[int]) -> int | None:
        """The CPU on which the clients' threads ran most since the last look (None:
        none ran, or none on a CPU the server may use)."""
        ran: Counter = Counter()
        seen = {}
        for pid in set(client_pids):
            for tid in threads_of(pid):
                got = thread_cpu(pid, tid)
                if got is None:
                    continue
                cpu, ns = got
                seen[(pid, tid)] = ns
                before = self.last.get((pid, tid))
                if before is not None and ns > before and cpu in self.allowed:
                    ran[cpu] += ns - before
        self.last = seen
        return ran.most_common(1)[0][0] if ran else None

    def follow(self, client_pids: Iterable[int], server_pids: Iterable[int]) -> None:
        """Crowded: pins the server's processes to the clients' CPU (again each time,
        so that a restarted process or a new thread is pinned too)."""
        cpu = self.caller_cpu(client_pids)
        if cpu is None:
            cpu = self.home
        if cpu is None:
            return
        if cpu != self.home:
            self.moves += 1
            log.debug("crowded CPUs: the server's processes run on CPU %d, with their caller", cpu)
        self.home = cpu
        pin(server_pids, {cpu})

    def release(self, server_pids: Iterable[int]) -> None:
        """Free again (or the watch rests): every allowed CPU, once."""
        self.last.clear()
        if self.home is None:
            return
        self.home = None
        pin(server_pids, self.allowed)
        log.debug("CPUs free again: the server's processes may run on every CPU")

    def status(self) -> dict:
        return {"home_cpu": self.home, "moves": self.moves}


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of each process (a thread's affinity is its own; new ones inherit
    their creator's)."""
    for pid in pids:
        for tid in threads_of(pid):
            try:
                if os.sched_getaffinity(tid) != cpus:
                    os.sched_setaffinity(tid, cpus)
            except OSError:  # gone meanwhile
                pass
