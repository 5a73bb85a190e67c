"""Send times of the request-rate mode.

A schedule is the time of every request relative to the start of the run, in
nanoseconds, fixed before the run: requests are measured from these intended
times, so a server (or client) that falls behind shows up as latency instead
of silently lowering the offered load (no coordinated omission).
"""
from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("constant", "poisson")


class Schedule:
    """Intended send offsets (ns from the start) at `rate` requests/s; produced in
    chunks so that a run of unknown length needs no precomputed array.

    constant: request i at i / rate.
    poisson:  exponential gaps with mean 1 / rate (a Poisson arrival process).
    Deterministic for a given seed.
    """

    def __init__(self, rate: float, distribution: str = "constant", seed: int = 0):
        if rate <= 0:
            raise ValueError(f"request rate must be > 0, got {rate}")
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"request distribution must be one of {DISTRIBUTIONS}, "
                             f"got '{distribution}'")
        self.rate, self.distribution = float(rate), distribution
        self._rng = np.random.default_rng(seed)
        self._i = 0
        self._t = 0.0  # seconds, poisson only

    def next(self, n: int) -> np.ndarray:
        """The next n send offsets, int64 ns, non-decreasing."""
        if self.distribution == "constant":
            idx = np.arange(self._i, self._i + n, dtype=np.float64)
            self._i += n
            return np.rint(idx * (1e9 / self.rate)).astype(np.int64)
        gaps = self._rng.exponential(1.0 / self.rate, n)
        t = self._t + np.cumsum(gaps)
        # the first request of a Poisson process arrives after one gap
        self._t = float(t[-1]) if n else self._t
        return np.rint(t * 1e9).astype(np.int64)

    def until(self, seconds: float, chunk: int = 65536) -> np.ndarray:
        """Every send offset before `seconds` (consumes the schedule)."""
        parts, limit = [], int(seconds * 1e9)
        while True:
            c = self.next(chunk)
            keep = c[c < limit]
            parts.append(keep)
            if len(keep) < len(c):
                return np.concatenate(parts)


def deal(offsets: np.ndarray, workers: int, index: int) -> np.ndarray:
    """The share of worker `index` of one schedule dealt round-robin over
    `workers` processes: together they send exactly the global schedule."""
    return offsets[index::workers]


class WorkerSchedule:
    """The round-robin share of one worker of a global Schedule, in chunks."""

    def __init__(self, rate: float, distribution: str, seed: int, workers: int, index: int,
                 chunk: int = 4096):
        self._sched = Schedule(rate, distribution, seed)
        self.workers, self.index, self.chunk = workers, index, chunk

    def next_chunk(self) -> np.ndarray:
        return deal(self._sched.next(self.chunk * self.workers), self.workers, self.index)
