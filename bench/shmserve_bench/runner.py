"""The sweep and the stability loop.

For each target (the main one, then each --compare endpoint, one after the other,
never at the same time) and each load level (a concurrency or a request rate):
start the client processes, let them warm up, then measure windows of
`measurement_interval_s` until the last `stability_windows` windows agree within
`stability_pct` on throughput and latency (perf_analyzer's rule), or
`max_trials` windows were measured, or the level's share of `duration_s` is
spent. The level's result is computed over the records of those last windows.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from . import cost as C
from . import inputs as I
from . import stats as S
from .load import LoadGroup, WorkerError
from .targets import label as target_label
from .targets import open_target


@dataclass
class BenchConfig:
    model: str
    url: str = "shm://default"           # shm://NAME, grpc://HOST:PORT, http://..., grpc+shm://...
    compare: list[str] = field(default_factory=list)
    version: int | None = None
    concurrency: list[int] | None = None   # concurrency mode (default [1])
    request_rate: list[float] | None = None  # request-rate mode, requests/s
    distribution: str = "constant"          # constant | poisson
    processes: int = 1                     # client processes per level
    batch_size: int = 1
    shapes: dict = field(default_factory=dict)
    input_data: str = "random"
    measurement_interval_s: float = 2.0     # -p (ms on the command line)
    stability_pct: float = 10.0             # -s
    stability_windows: int = 3
    max_trials: int = 10                    # -r
    percentile: float | None = None         # stability on this latency percentile (else mean)
    warmup_s: float = 1.0
    duration_s: float | None = None         # upper bound on the whole run
    timeout_s: float = 30.0                 # per request
    seed: int = 0
    target_options: dict = field(default_factory=dict)  # Client(arena_bytes=, spin_us=)
    progress: object = None                 # callable(str) or None
    collect_server_stats: bool = True
    server_pid: int | None = None           # CPU of this process tree = server CPU (KServe targets)

    def levels(self) -> list[tuple[str, float]]:
        if self.request_rate:
            return [("rate", float(r)) for r in self.request_rate]
        return [("concurrency", int(c)) for c in (self.concurrency or [1])]


@dataclass
class LevelResult:
    mode: str
    value: float
    stable: bool
    windows: list[dict]
    summary: dict                 # throughput, n, errors, latency_us{p50.., mean, max}
    breakdown: list[dict]
    measured_s: float
    processes: int
    client_cpu_pct: float | None = None
    client_cpu_us_per_request: float | None = None
    server_cpu_pct: float | None = None
    server_cpu_us_per_request: float | None = None     # the whole server tree, model included
    server_cpu_us_by_role: dict | None = None          # role -> us/request (cost.py)
    model_us_per_request: float | None = None          # the model's execution time
    server_overhead_us_per_request: float | None = None  # server CPU less the model's time
    machine_busy_pct: float | None = None
    errors_total: dict = field(default_factory=dict)   # message -> count, whole level
    requests_total: int = 0
    send_lag_us: dict | None = None   # request-rate mode: sent - intended
    server_stats: dict | None = None  # shmserve: counters of this level (delta)
    note: str = ""
    latencies_us: np.ndarray | None = None  # not serialized

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("latencies_us", None)
        return d


@dataclass
class TargetResult:
    url: str
    label: str
    model: str
    levels: list[LevelResult] = field(default_factory=list)
    metadata: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {"url": self.url, "label": self.label, "model": self.model,
                "metadata": self.metadata, "error": self.error,
                "levels": [lv.to_dict() for lv in self.levels]}


def machine_ticks() -> tuple[int, int]:
    """(all, idle + iowait) ticks of all CPUs since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v), v[3] + v[4]


def _say(cfg: BenchConfig, text: str) -> None:
    if cfg.progress is True:
        print(text, file=sys.stderr, flush=True)
    elif callable(cfg.progress):
        cfg.progress(text)


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def model_row(client, model: str) -> dict | None:
    """The model's statistics row (its newest version), None if unavailable."""
    try:
        rows = client.statistics(model)
    except Exception:  # noqa: BLE001 - statistics are a bonus
        return None
    return max(rows, key=lambda r: int(r.get("version", 0))) if rows else None


def _stats_of(client, model: str) -> dict | None:
    row = model_row(client, model)
    if row is None:
        return None
    counts = row["inference_stats"]
    return {"request_success": counts["success"]["count"],
            "request_failure": counts["fail"]["count"],
            "execution_count": row["execution_count"],
            "batch_requests": {int(k): int(v)
                               for k, v in row["shmserve"]["batch_requests"].items()}}


def _stats_delta(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return None
    out = {k: b[k] - a[k] for k in ("request_success", "request_failure", "execution_count")}
    hist = {n: c - a["batch_requests"].get(n, 0) for n, c in b["batch_requests"].items()}
    out["batch_requests"] = {n: c for n, c in sorted(hist.items()) if c > 0}
    return out


def run_level(cfg: BenchConfig, url: str, mode: str, value, data_sets: list[dict],
              budget_s: float | None, sampler: C.ServerSampler, tag: str) -> LevelResult:
    """One load level against one target."""
    if mode == "concurrency":
        shares = _split(int(value), cfg.processes)
        specs = [{"concurrency": c} for c in shares]
    else:
        n = max(1, cfg.processes)
        specs = [{"rate": float(value), "workers": n, "index": i} for i in range(n)]
    base = {"url": url, "model": cfg.model, "version": cfg.version, "mode": mode,
            "data_sets": data_sets, "distribution": cfg.distribution, "seed": cfg.seed,
            "timeout_s": cfg.timeout_s, "target_options": cfg.target_options}
    specs = [{**base, **s} for s in specs]
    window_s = cfg.measurement_interval_s
    started = time.monotonic()
    key = S.pkey(cfg.percentile) if cfg.percentile is not None else "mean"
    windows, per_window, samples, ticks = [], [], [], []
    stable, note = False, ""
    group = LoadGroup(specs)
    try:
        group.start(cfg.warmup_s, window_s)
        # Server and machine CPU are sampled as soon as every client process has
        # reported a window boundary (boundary 0: the end of the warm-up), where the
        # clients take theirs: every CPU figure covers the windows it is given for.
        k = 0
        while True:
            recs = group.window(k, window_s + cfg.warmup_s + cfg.timeout_s + 10)
            if recs is None:
                what = f"window {k}" if k else "the warm-up"
                note = f"{what} did not complete within {cfg.timeout_s + 10:.0f} s of its end"
                break
            samples.append(sampler.sample())
            ticks.append(machine_ticks())
            if k == 0:
                k = 1
                continue
            w = S.summarize(recs, window_s)
            windows.append(w)
            per_window.append(recs)
            stable = S.is_stable(windows, cfg.stability_pct, cfg.stability_windows, key)
            _say(cfg, f"  [{tag}] {mode} {value:g}: window {k}: {w['throughput']:,.0f} infer/s, "
                      f"p50 {w['latency_us']['p50']:,.1f} us, p99 {w['latency_us']['p99']:,.1f} us, "
                      f"errors {w['errors']}{', stable' if stable else ''}")
            if stable or k >= cfg.max_trials:
                break
            if budget_s is not None and time.monotonic() - started + window_s > budget_s:
                note = f"stopped by the time bound after {k} window(s)"
                if k < cfg.stability_windows:
                    note += (f" (a stable result needs {cfg.stability_windows}; this level's "
                             f"share of --duration was {budget_s:.1f} s, of which start-up and "
                             f"warm-up took {(group.w0 / 1e9) - started:.1f} s)")
                break
            k += 1
    finally:
        group.stop(cfg.timeout_s + 10)
    used = windows[-cfg.stability_windows:]
    first = len(windows) - len(used) + 1  # 1-based index of the first window used
    recs = np.concatenate(per_window[-len(used):]) if used else S.empty_records()
    seconds = len(used) * window_s
    summary = S.summarize(recs, seconds) if used else S.summarize(S.empty_records(), 0)
    ok = recs[recs[:, S.OK] == 1] if len(recs) else recs
    res = LevelResult(mode=mode, value=value, stable=stable, windows=windows, summary=summary,
                      breakdown=S.breakdown(recs), measured_s=seconds, processes=len(specs),
                      note=note, errors_total=dict(group.errors_total),
                      requests_total=int(len(group.pool)),
                      latencies_us=S.latency_ns(ok) / 1000.0)
    if used:
        c = group.cpu_seconds(first - 1, len(windows))
        sent = summary["n"] + summary["errors"]
        if c is not None:
            res.client_cpu_pct = 100.0 * c / seconds
            if sent:
                res.client_cpu_us_per_request = 1e6 * c / sent
        srv = C.server_cost(samples[first - 1], samples[len(windows)], requests=sent)
        if srv is not None:
            res.server_cpu_pct = srv["cpu_pct"]
            res.server_cpu_us_per_request = srv["total_us"]
            res.server_cpu_us_by_role = srv["us_per_request"]
            res.model_us_per_request = srv["model_us"]
            res.server_overhead_us_per_request = srv["overhead_us"]
        (t0, i0), (t1, i1) = ticks[first - 1], ticks[len(windows)]
        if t1 > t0:
            res.machine_busy_pct = 100.0 * ((t1 - t0) - (i1 - i0)) / (t1 - t0) * (os.cpu_count() or 1)
    if mode == "rate" and len(ok):
        res.send_lag_us = S.percentiles((ok[:, S.SENT] - ok[:, S.INTENDED]) / 1000.0, (50, 99))
    return res


def run_target(cfg: BenchConfig, url: str, deadline: float | None, levels_left: int,
               on_level=None) -> TargetResult:
    tr = TargetResult(url=url, label=target_label(url), model=cfg.model)
    try:
        probe = open_target(url, cfg.model, version=cfg.version, timeout_s=cfg.timeout_s,
                            options=cfg.target_options)
    except Exception as e:  # noqa: BLE001 - reported in the result
        tr.error = f"cannot open {url}: {type(e).__name__}: {e}"
        _say(cfg, f"[{tr.label}] {tr.error}")
        return tr
    try:
        tr.metadata = meta = probe.metadata()
        data_sets = I.load(meta, cfg.input_data, cfg.shapes, cfg.batch_size, cfg.seed)
        server_pid = probe.server_pid() or cfg.server_pid
        client = getattr(probe, "client", None) if url_scheme(url) == "shm" else None
        stats = (lambda: model_row(client, cfg.model)) if client is not None else None
        # shmserve's roles are told apart; a KServe server's tree is one "server"
        sampler = C.ServerSampler(server_pid, stats, by_role=client is not None)
        for mode, value in cfg.levels():
            budget = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    tr.error = "time bound (--duration) reached before every level ran"
                    break
                budget = left / max(1, levels_left)
            levels_left -= 1
            _say(cfg, f"[{tr.label}] model {cfg.model}: {mode} {value:g}")
            before = _stats_of(client, cfg.model) if client and cfg.collect_server_stats else None
            lv = run_level(cfg, url, mode, value, data_sets, budget, sampler, tr.label)
            if client is not None and cfg.collect_server_stats:
                lv.server_stats = _stats_delta(before, _stats_of(client, cfg.model))
            tr.levels.append(lv)
            if on_level is not None:
                on_level(tr, lv)
    except (WorkerError, I.InputError, OSError, RuntimeError, ValueError) as e:
        tr.error = f"{type(e).__name__}: {e}"
        _say(cfg, f"[{tr.label}] failed: {tr.error}")
    except Exception as e:  # noqa: BLE001 - a target's own errors (tritonclient, shmserve)
        tr.error = f"{type(e).__name__}: {e}"
        _say(cfg, f"[{tr.label}] failed: {tr.error}")
    finally:
        probe.close()
    return tr


def url_scheme(url: str) -> str:
    from .targets import parse_url
    return parse_url(url)[0]


def run_benchmark(cfg: BenchConfig, on_level=None) -> list[TargetResult]:
    """Every target, one after the other; returns one TargetResult each."""
    deadline = time.monotonic() + cfg.duration_s if cfg.duration_s else None
    urls = [cfg.url, *cfg.compare]
    n_levels = len(cfg.levels())
    results = []
    for i, url in enumerate(urls):
        results.append(run_target(cfg, url, deadline, n_levels * (len(urls) - i), on_level))
    return results


def errors_of(results: list[TargetResult]) -> Counter:
    total: Counter = Counter()
    for tr in results:
        for lv in tr.levels:
            total.update(lv.errors_total)
    return total
