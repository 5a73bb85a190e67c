"""A model's statistics as Triton's statistics extension shapes them, read from the
counters the batcher and the workers keep in the server segment (csrc/shms_stats.h),
plus quantiles from their latency histograms.

    {"name", "version" (a string), "last_inference" (ms since the epoch),
     "inference_count", "execution_count",
     "inference_stats": {success, fail, queue, compute_input, compute_infer,
                         compute_output, cache_hit, cache_miss: {"count", "ns"}},
     "response_stats": {}, "batch_stats": [{"batch_size", "compute_input",
     "compute_infer", "compute_output"}], "memory_usage": [{"type", "id", "byte_size"}],
     "shmserve": {state, pending, failures {reason: n}, batch_requests, ...}}

Durations are summed over requests, as Triton sums them: an execution of 4 requests
that ran 1 ms adds 4 ms to compute_infer (and 1 ms to batch_stats for its size).
success/fail time a request from the batcher taking it off the ring to its answer.
The "shmserve" key holds what Triton has no field for; the network fronts leave it out.
"""
from __future__ import annotations

import functools

import numpy as np

from ..protocol import LAYOUT, Duration, FailureReason

BUCKETS = LAYOUT["LATENCY_BUCKETS"]
DURATION_NAMES = [d.name.lower() for d in Duration]  # success, fail, queue, compute_*, ...


@functools.cache
def bucket_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds (ns) of the histogram buckets of shms_latency_bucket():
    exact below 8 ns, then 8 buckets per power of two."""
    b = np.arange(BUCKETS, dtype=np.int64)
    shift = np.maximum(b // 8 - 1, 0)
    low = np.where(b < 8, b, (8 + b % 8) << shift)
    width = np.where(b < 8, 1, 1 << shift)
    return low.astype(np.float64), (low + width).astype(np.float64)


def histograms(raw: dict) -> np.ndarray:
    """The latency counts of a snapshot as an array [Duration][bucket]."""
    return np.frombuffer(raw["latency"], np.uint64).reshape(len(Duration), BUCKETS)


def quantiles(counts: np.ndarray, qs) -> list[float | None]:
    """Quantiles (ns) of a histogram, interpolated inside the bucket holding each
    rank (within 6 % of the true value); None when the histogram is empty."""
    total = int(counts.sum())
    if total == 0:
        return [None for _ in qs]
    low, high = bucket_bounds()
    cum = np.cumsum(counts, dtype=np.float64)
    out = []
    for q in qs:
        rank = min(max(q, 0.0), 1.0) * total
        i = min(int(np.searchsorted(cum, rank, side="left")), BUCKETS - 1)
        before = cum[i - 1] if i else 0.0
        inside = (rank - before) / counts[i] if counts[i] else 0.0
        out.append(float(low[i] + (high[i] - low[i]) * min(max(inside, 0.0), 1.0)))
    return out


def _duration(pair) -> dict:
    count, ns = pair
    return {"count": int(count), "ns": int(ns)}


def model_statistics(name: str, version: int, state: str, raw: dict,
                     memory_usage: list[dict] = (), with_histograms: bool = False) -> dict:
    """One model_stat of Triton's statistics extension from a model_stats() snapshot."""
    # Triton's inference_stats has no first-response pair: its histogram alone is kept
    inference = {n: _duration(raw["durations"][d]) for n, d in zip(DURATION_NAMES, Duration)
                 if d != Duration.FIRST_RESPONSE}
    batch_stats = [{"batch_size": size, "compute_input": _duration(stages[0]),
                    "compute_infer": _duration(stages[1]), "compute_output": _duration(stages[2])}
                   for size, stages in sorted(raw["batch_stats"].items())]
    own = {"state": state, "pending": raw["pending"],
           "failures": {r.name: int(raw["failures"][r]) for r in FailureReason},
           "batch_requests": {str(n): c for n, c in sorted(raw["batch_requests"].items())},
           # decoupled models: from a request's arrival to its first response
           "first_response": _duration(raw["durations"][Duration.FIRST_RESPONSE])}
    if with_histograms:  # sparse: [[bucket, count], ...] per duration
        hist = histograms(raw)
        own["histograms"] = {n: [[int(b), int(hist[d][b])] for b in np.flatnonzero(hist[d])]
                             for n, d in zip(DURATION_NAMES, Duration)}
    return {"name": name, "version": str(version), "last_inference": raw["last_inference_ms"],
            "inference_count": raw["inference_count"], "execution_count": raw["execution_count"],
            "inference_stats": inference, "response_stats": {}, "batch_stats": batch_stats,
            "memory_usage": list(memory_usage), "shmserve": own}


def dense(sparse: list) -> np.ndarray:
    """A histogram sent sparse ([[bucket, count], ...]) as counts per bucket."""
    counts = np.zeros(BUCKETS, np.float64)
    for b, c in sparse:
        if 0 <= b < BUCKETS:
            counts[b] += c
    return counts


def triton_only(model_stat: dict) -> dict:
    """A model_stat without shmserve's own key, as Triton's fronts answer it."""
    return {k: v for k, v in model_stat.items() if k != "shmserve"}
