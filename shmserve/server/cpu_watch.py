"""The coordinator's watch on the machine's CPUs: is one left idle to spin on?

A waiter spins (shms_wait.h) to save a futex wake-up, which on a small virtual machine
costs more than a whole round trip because an idle vCPU must be woken. That pays only
while a CPU would otherwise sit idle. When other work keeps every CPU busy, a spin takes
the CPU from it, or from the very process the spinner waits for; and a server started
in its own session or cgroup is its own scheduling group, whose spinners are seldom
preempted, so the spin policy's own detection (a yield that lost the CPU) misses them.

So the coordinator measures, every interval, the CPU time that the CPUs it may run on
spent busy, less that of this server's processes and of its clients: the time other
work took. While the CPUs that work leaves free are fewer than CROWDED_BELOW, it raises
`crowded` (the control block's word for clients, the server header's for the server's
own waiters) and every waiter sleeps at once instead of spinning. Busy CPUs also make a
wake-up cheap (no vCPU to wake), so little is lost: on 2 vCPUs with a CPU-bound process
on each, the 4 KiB round trip's p50 went from about 60 us (spinning) to about 20 us.
A client's other threads count as the client's: their load does not crowd it out.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Callable, Iterable

import psutil

log = logging.getLogger("shmserve.cpu_watch")

CROWDED_BELOW = 1.5  # free CPUs under which waiters stop spinning ...
CLEAR_MARGIN = 0.25  # ... and from this many more spin again (measurements are in ticks)
RESTING_CHECK_S = 1.0  # with no client connected, look this often whether one came


def busy_cpu_seconds(cpus: set[int]) -> float:
    """CPU time the given CPUs spent busy since boot (all but idle and iowait; steal
    counts: a hypervisor's other guests take the CPU as surely as a neighbour does)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *fields = line.split()
            if name == "cpu" or int(name[3:]) not in cpus:
                continue
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            busy += user + nice + system + irq + softirq + steal  # guest is within user
    return busy / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class CpuWatch:
    """The judgement, fed one measurement at a time (pure, so tests can drive it)."""
    cpus: int
    crowded: bool = False
    free_cpus: float | None = None  # of the last interval
    changes: int = 0  # how often `crowded` flipped
    resting: bool = False  # no client is connected: nobody waits, nothing is measured

    @property
    def limit(self) -> float:
        # a machine of one CPU spins while it is quiet, as before (spinning needs half a CPU)
        return min(CROWDED_BELOW, self.cpus - 0.5)

    def judge(self, busy_s: float, ours_s: float, wall_s: float) -> bool:
        """One interval: its busy CPU seconds, those of our processes, its length.
        Returns whether `crowded` changed."""
        other = max(0.0, busy_s - ours_s) / wall_s
        self.free_cpus = max(0.0, self.cpus - other)
        bar = self.limit + (CLEAR_MARGIN if self.crowded else 0.0)
        crowded = self.free_cpus < bar
        changed = crowded != self.crowded
        self.crowded = crowded
        self.changes += changed
        return changed

    def rest(self) -> bool:
        """No client is connected: nothing is judged until one is, and `crowded` is
        lowered. Returns whether `crowded` changed."""
        self.resting, self.free_cpus = True, None
        changed = self.crowded
        self.crowded = False
        self.changes += changed
        return changed

    def status(self) -> dict:
        return {"crowded": self.crowded, "cpus": self.cpus, "changes": self.changes,
                "free_cpus": None if self.free_cpus is None else round(self.free_cpus, 2),
                "resting": self.resting}


def started_since_boot(pid: int) -> float:
    """When the process started, in seconds since boot (/proc/<pid>/stat's starttime:
    psutil's create_time adds a boot time rounded to the second)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # after the command name
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


class ProcessClock:
    """CPU seconds (user + system, all threads) of a changing set of processes, per
    interval. A process born within the interval counts whole; one that existed before
    but is seen for the first time (a client that just connected) makes the interval's
    figure unknown, since its share of the interval cannot be told."""

    def __init__(self):
        self.seen: dict[int, tuple[psutil.Process, float]] = {}
        self.last_sample = time.clock_gettime(time.CLOCK_BOOTTIME)

    def spent(self, pids: Iterable[int]) -> float | None:
        """CPU seconds since the last call, or None where a newcomer's are unknown."""
        total, seen, known = 0.0, {}, True
        since, self.last_sample = self.last_sample, time.clock_gettime(time.CLOCK_BOOTTIME)
        for pid in set(pids):
            proc, last = self.seen.get(pid, (None, None))
            try:
                proc = proc or psutil.Process(pid)
                t = proc.cpu_times()
                if last is None and started_since_boot(pid) >= since:
                    last = 0.0  # born within the interval: all of its time is in it
            except (psutil.Error, OSError):  # gone, or not ours to read
                continue
            now = t.user + t.system
            if last is None:
                known = False
            else:
                total += max(0.0, now - last)
            seen[pid] = (proc, now)
        self.seen = seen
        return total if known else None


async def watch(state: CpuWatch, interval_s: float, our_pids: Callable[[], Iterable[int]],
                publish: Callable[[bool], None], stop: asyncio.Event,
                clients: Callable[[], bool] = lambda: True,
                place: Callable[[bool], None] = lambda crowded: None) -> None:
    """Measures every interval_s until stop, and publishes each change of `crowded`;
    place(crowded) after every judged interval and when it rests (placement.py).
    While clients() is false (no client connected) it rests, looking every
    RESTING_CHECK_S whether one came: nobody waits then, and measuring every interval
    would double what an idle coordinator costs (docs/architecture.md, "The CPU
    watch"). An HTTP or gRPC front holds a lease, so with fronts it never rests."""
    cpus = os.sched_getaffinity(0)
    clock = ProcessClock()
    baseline = True  # the next sample only starts an interval
    while not stop.is_set():
        if not clients():
            if state.rest():
                publish(False)
            place(False)
            baseline = True
        elif baseline:
            state.resting, baseline = False, False
            clock.spent(our_pids())
            wall, busy = time.monotonic(), busy_cpu_seconds(cpus)
        else:
            ours = clock.spent(our_pids())
            now, busy_now = time.monotonic(), busy_cpu_seconds(cpus)
            # an interval in which a running process became ours is not judged
            if ours is not None and state.judge(busy_now - busy, ours, now - wall):
                publish(state.crowded)
                log.debug("CPUs %s: %.2f of %d left free by other work: waiters %s",
                          "crowded" if state.crowded else "free again", state.free_cpus,
                          state.cpus, "sleep at once" if state.crowded else "spin again")
            if ours is not None:
                place(state.crowded)
            wall, busy = now, busy_now
        try:
            await asyncio.wait_for(stop.wait(), RESTING_CHECK_S if baseline else interval_s)
            break
        except asyncio.TimeoutError:
            pass
