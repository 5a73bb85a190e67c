"""What a request costs in CPU, by process role.

A shmserve server is a process tree: the coordinator (the server's own pid: control
socket, intake, metrics endpoint), the batcher (`python -m shmserve.server.batcher`)
and one worker per model instance (`python -m shmserve.server.worker`). A Sample
holds the CPU time (user + system, from /proc) of every process of the tree and the
model's counters from the server's statistics. Two samples give CPU per request by
role: the CPU each role used in between, divided by the requests the server answered
in between.

The workers run the model, and the model's work is not server overhead: the model's
execution time from the statistics (wall time of each execution, summed over
executions; the worker's thread is busy with the model for all of it when the model
runs on that thread, as onnxruntime with intra_op 1 and the Python models do) is
taken out as "model". On a machine where the worker is descheduled during an
execution, that wall time exceeds the CPU it used, and "workers less model" reads low.

KServe servers (Triton) are one role, "server": the CPU of their whole tree.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from . import proctree

ROLES = ("coordinator", "batcher", "workers")
_MODULE_ROLES = {"shmserve.server.batcher": "batcher", "shmserve.server.worker": "workers"}


def model_compute_ns(row: dict) -> int | None:
    """The model's execution time so far (ns) in one model's statistics (Triton's
    statistics extension shape): the compute_infer time of every execution, from
    batch_stats — inference_stats.compute_infer sums it over the requests of each
    batch, which counts a batch of n n times. None when the row has no statistics."""
    try:
        return sum(int(b["compute_infer"]["ns"]) for b in row["batch_stats"])
    except (KeyError, TypeError, ValueError):
        return None


def model_requests(row: dict) -> int | None:
    """Requests the model has answered so far, successful or failed; None when the
    row has no statistics."""
    try:
        s = row["inference_stats"]
        return int(s["success"]["count"]) + int(s["fail"]["count"])
    except (KeyError, TypeError, ValueError):
        return None


def role_of(argv: list[str]) -> str:
    """The role of a non-root process of a shmserve server, from its command line."""
    for i, a in enumerate(argv[:-1]):
        if a == "-m" and argv[i + 1] in _MODULE_ROLES:
            return _MODULE_ROLES[argv[i + 1]]
    return "other"


@dataclass
class Sample:
    at_ns: int                                   # CLOCK_MONOTONIC when taken
    ticks: dict = field(default_factory=dict)    # pid -> (role, utime + stime in clock ticks)
    requests: int | None = None                  # the model's answered requests so far
    compute_ns: int | None = None                # the model's execution time so far


class ServerSampler:
    """Samples a server's process tree (and, given `stats`, a callable returning the
    model's statistics row, its counters). by_role=False: the whole tree is one role,
    "server" (a KServe server); pid None: no server CPU (only the timestamp)."""

    def __init__(self, pid: int | None, stats=None, by_role: bool = True):
        self.pid, self.stats, self.by_role = pid, stats, by_role
        self._roles: dict[int, str] = {}

    def _role(self, pid: int) -> str:
        if not self.by_role:
            return "server"
        if pid == self.pid:
            return "coordinator"
        if pid not in self._roles:
            self._roles[pid] = role_of(proctree.cmdline(pid))
        return self._roles[pid]

    def sample(self) -> Sample:
        s = Sample(at_ns=time.monotonic_ns())
        if self.pid is not None:
            table = proctree.processes()
            if self.pid in table:
                s.ticks = {p: (self._role(p), table[p].cpu_ticks)
                           for p in proctree.descendants(self.pid, table) if p in table}
        if self.stats is not None:
            try:
                row = self.stats()
            except Exception:  # noqa: BLE001 - statistics are a bonus; CPU still counts
                row = None
            if row:
                s.requests, s.compute_ns = model_requests(row), model_compute_ns(row)
        return s


def server_cost(a: Sample, b: Sample, requests: int | None = None) -> dict | None:
    """Server CPU between two samples. `requests`: the count to divide by when the
    samples carry none (a KServe server: what the client completed in between).

    Returns {"requests", "elapsed_s", "cpu_s", "cpu_pct", "us_per_request": {role: us,
    ...}, "total_us", "model_us", "overhead_us"} (model_us and overhead_us None without
    the model's execution time), or None when there is no process or no request.
    A process that started in between counts all its CPU; one that ended in between
    counts none of its last stretch (/proc has forgotten it)."""
    if not b.ticks:
        return None
    if a.requests is not None and b.requests is not None:
        requests = b.requests - a.requests
    if not requests or requests <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    by_role: dict[str, int] = {}
    for pid, (role, t1) in b.ticks.items():
        t0 = a.ticks.get(pid, (role, 0))[1]
        by_role[role] = by_role.get(role, 0) + max(0, t1 - t0)
    cpu_s = sum(by_role.values()) / hz
    elapsed = (b.at_ns - a.at_ns) / 1e9
    roles = {r: 1e6 * t / hz / requests for r, t in sorted(by_role.items(), key=_role_order)}
    total = 1e6 * cpu_s / requests
    model = None
    if a.compute_ns is not None and b.compute_ns is not None:
        model = (b.compute_ns - a.compute_ns) / 1e3 / requests
    return {"requests": int(requests), "elapsed_s": elapsed, "cpu_s": cpu_s,
            "cpu_pct": 100.0 * cpu_s / elapsed if elapsed > 0 else None,
            "us_per_request": roles, "total_us": total, "model_us": model,
            "overhead_us": None if model is None else total - model}


def _role_order(item) -> int:
    order = (*ROLES, "server", "other")
    return order.index(item[0]) if item[0] in order else len(order)


def child_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have ended and
    been waited for: the difference around subprocess.run() is that child's CPU."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
