"""Statistics of a benchmark: percentiles, windows, stability, latency breakdown.

Every time is an int64 of CLOCK_MONOTONIC nanoseconds (the clock of the slot
timestamps, the same in every process of the machine). Reported latencies are
microseconds.
"""
from __future__ import annotations

import numpy as np

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)

# Columns of a record array (one row per request); stamps are protocol.Timestamp.
INTENDED, SENT, END, OK = 0, 1, 2, 3
STAMP0 = 4
N_STAMPS = 8
N_COLS = STAMP0 + N_STAMPS

# (label, from, to): columns of a record; the stages of one request, in order.
STAGES = [
    ("send lag (intended -> sent)", INTENDED, SENT),
    ("client: call -> written", SENT, STAMP0 + 0),
    ("written -> enqueued (ring push)", STAMP0 + 0, STAMP0 + 1),
    ("enqueued -> dequeued (batcher wakes)", STAMP0 + 1, STAMP0 + 2),
    ("dequeued -> batch formed", STAMP0 + 2, STAMP0 + 3),
    ("batch formed -> compute start", STAMP0 + 3, STAMP0 + 4),
    ("compute (model)", STAMP0 + 4, STAMP0 + 5),
    ("compute end -> complete (publish)", STAMP0 + 5, STAMP0 + 6),
    ("complete -> caller wakes", STAMP0 + 6, STAMP0 + 7),
    ("caller wakes -> returned", STAMP0 + 7, END),
]


def pkey(q: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{q:g}"


def percentiles(values, qs=PERCENTILES) -> dict[str, float]:
    """Percentiles (linear interpolation, numpy's default) of `values`; NaN when empty."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {pkey(q): float("nan") for q in qs}
    return dict(zip((pkey(q) for q in qs), (float(x) for x in np.percentile(v, list(qs)))))


def empty_records() -> np.ndarray:
    return np.zeros((0, N_COLS), np.int64)


def latency_ns(records: np.ndarray) -> np.ndarray:
    """End minus intended send time: in request-rate mode this includes the time a
    request waited to be sent (no coordinated omission); in concurrency mode the
    intended time is the send time."""
    return records[:, END] - records[:, INTENDED]


def in_window(records: np.ndarray, start_ns: int, end_ns: int) -> np.ndarray:
    """Requests that completed in [start, end)."""
    e = records[:, END]
    return records[(e >= start_ns) & (e < end_ns)]


def summarize(records: np.ndarray, seconds: float, qs=PERCENTILES) -> dict:
    """Throughput (successful completions per second), latency percentiles and mean
    in microseconds over the successful requests, and the error count."""
    ok = records[records[:, OK] == 1] if len(records) else records
    lat_us = latency_ns(ok) / 1000.0 if len(ok) else np.zeros(0)
    out = {
        "throughput": len(ok) / seconds if seconds > 0 else float("nan"),
        "n": int(len(ok)),
        "errors": int(len(records) - len(ok)),
        "latency_us": percentiles(lat_us, qs),
    }
    out["latency_us"]["mean"] = float(lat_us.mean()) if len(lat_us) else float("nan")
    out["latency_us"]["max"] = float(lat_us.max()) if len(lat_us) else float("nan")
    return out


def within(values, pct: float) -> bool:
    """True if every value is within +-pct % of their mean (perf_analyzer's
    stability rule); all-zero values are stable."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or np.isnan(v).any():
        return False
    mean = v.mean()
    if mean == 0:
        return bool((v == 0).all())
    return bool((np.abs(v - mean) <= abs(mean) * pct / 100.0).all())


def is_stable(windows: list[dict], pct: float, count: int = 3, latency_key: str = "mean") -> bool:
    """The last `count` window summaries agree on throughput and on latency
    (`latency_key`: 'mean' or a percentile key such as 'p99') within pct %."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    return (within([w["throughput"] for w in last], pct)
            and within([w["latency_us"][latency_key] for w in last], pct))


def breakdown(records: np.ndarray, qs=(50.0, 90.0, 99.0)) -> list[dict]:
    """Per stage of a request (STAGES), percentiles in microseconds over the
    successful requests where both ends were stamped (a KServe endpoint stamps
    none of the server stages; their rows are left out). Percentiles of stages do
    not add up to the percentile of the round trip."""
    ok = records[records[:, OK] == 1] if len(records) else records
    rows = []
    for label, a, b in STAGES:
        if not len(ok):
            break
        have = (ok[:, a] > 0) & (ok[:, b] > 0)
        if not have.any():
            continue
        d = (ok[have, b] - ok[have, a]) / 1000.0
        if a == INTENDED and not d.any():
            continue  # concurrency mode: sent when intended
        rows.append({"stage": label, "n": int(have.sum()), **percentiles(d, qs),
                     "mean": float(d.mean())})
    return rows


def cdf(values, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(sorted sample of values, cumulative fraction) with at most `points` points
    (the tail kept in full resolution via a log-spaced grid of quantiles)."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        return v, v
    # quantiles dense near 1: 1 - logspace(0, -5)
    q = np.unique(np.clip(np.concatenate([np.linspace(0, 0.9, points // 2),
                                          1 - np.logspace(-1, -5, points // 2), [1.0]]), 0, 1))
    return np.quantile(v, q), q
