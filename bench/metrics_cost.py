#!/usr/bin/env python3
"""What the Prometheus metrics cost per request (issue 9).

    .venv/bin/python bench/metrics_cost.py              # about 1.5 minutes on 2 cores
    .venv/bin/python bench/metrics_cost.py --pairs 3 --window-ms 500   # quicker look

Two private shmserve servers on model_repository/, both up for the whole run and
otherwise idle: "on" with --metrics-port, scraped every second (GET /metrics from a
thread of this process) while it is measured, and "off" without the option. The
load: identity FP32 [1,1024] (4 KiB), 1 caller, closed loop, through shmserve_bench
(windows after a warm-up until 3 agree within 10 %). Measured in turn, one server at a
time, in pairs whose order alternates (on off, off on, ...) so that a drift of the
machine cancels out. Per pair, on minus off: time per request (1 / throughput, the
closed loop's mean round trip), p50, server CPU per request and its part by role (the
metrics endpoint is a thread of the coordinator). The report gives
the median of each difference over the pairs, and the range. The scraper runs on the
same machine, so the time per request includes its CPU; the server CPU figures do not.
Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from shmserve_bench import BenchConfig, run_benchmark  # noqa: E402
from shmserve_bench.harness import ServerProcess  # noqa: E402

FIGURES = {  # name -> (label, function of a level)
    "time_us": ("time per request (1 / throughput)", lambda lv: 1e6 / lv.summary["throughput"]),
    "p50_us": ("p50 round trip", lambda lv: lv.summary["latency_us"]["p50"]),
    "server_us": ("server CPU per request", lambda lv: lv.server_cpu_us_per_request),
    **{f"{role}_us": (f"{role} CPU per request",
                      lambda lv, role=role: (lv.server_cpu_us_by_role or {}).get(role))
       for role in ("coordinator", "batcher", "workers")},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scraper:
    """GET /metrics every `period_s` in a thread while the with-block lasts; counts
    the scrapes and keeps the first failure."""

    def __init__(self, port: int, period_s: float = 1.0):
        self.url, self.period = f"http://127.0.0.1:{port}/metrics", period_s
        self.scrapes, self.error = 0, None
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    body = r.read()
                if b"nv_inference_request_success" not in body:
                    raise RuntimeError("no nv_inference_request_success family in the answer")
                self.scrapes += 1
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                self.error = self.error or f"{self.url}: {type(e).__name__}: {e}"
            self._stop.wait(self.period)

    def __enter__(self) -> Scraper:
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def _level(server: ServerProcess, window_ms: int, warmup: float, max_trials: int):
    cfg = BenchConfig(model="identity", url=f"shm://{server.name}", shapes={"INPUT0": [1024]},
                      concurrency=[1], measurement_interval_s=window_ms / 1000.0,
                      warmup_s=warmup, max_trials=max_trials, stability_pct=10.0,
                      target_options={"arena_bytes": 16 << 20,
                                      "socket_path": str(server.socket_path)})
    (tr,) = run_benchmark(cfg)
    if tr.error or not tr.levels:
        raise RuntimeError(f"identity 4 KiB against '{server.name}' failed: {tr.error}")
    return tr.levels[0]


def measure(repo: Path, log_dir: Path, pairs: int = 5, window_ms: int = 1000,
            warmup: float = 0.5, max_trials: int = 5, say=print) -> dict:
    """The A/B run; returns {"pairs": [{"on": {...}, "off": {...}}], "median": {figure:
    difference}, "range": {figure: (min, max)}, "scrapes", "notes"}."""
    port = free_port()
    on = ServerProcess(repo, log_path=log_dir / "metrics_cost.on.server.log", name_prefix="bench-on-",
                       args=["--metrics-port", str(port)])
    off = ServerProcess(repo, log_path=log_dir / "metrics_cost.off.server.log",
                        name_prefix="bench-off-")
    out = {"pairs": [], "scrapes": 0, "notes": [], "metrics_port": port}
    try:
        on.start(timeout=60)
        off.start(timeout=60)
        for i in range(pairs):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            pair = {}
            for which in order:
                say(f"  metrics cost: pair {i + 1}/{pairs}, metrics {which} ...")
                if which == "on":
                    with Scraper(port) as scraper:
                        lv = _level(on, window_ms, warmup, max_trials)
                    out["scrapes"] += scraper.scrapes
                    if scraper.error:
                        out["notes"].append(f"pair {i + 1}: scrape failed: {scraper.error}")
                else:
                    lv = _level(off, window_ms, warmup, max_trials)
                pair[which] = {k: fn(lv) for k, (_, fn) in FIGURES.items()}
                pair[which]["stable"] = lv.stable
            out["pairs"].append(pair)
    finally:
        for s in (on, off):
            out["notes"] += [f"server '{s.name}': {p}" for p in s.teardown()]
    diffs = {k: [p["on"][k] - p["off"][k] for p in out["pairs"]
                 if p["on"][k] is not None and p["off"][k] is not None] for k in FIGURES}
    out["median"] = {k: float(np.median(v)) if v else None for k, v in diffs.items()}
    out["range"] = {k: (min(v), max(v)) if v else None for k, v in diffs.items()}
    out["on"] = {k: _med([p["on"][k] for p in out["pairs"]]) for k in FIGURES}
    out["off"] = {k: _med([p["off"][k] for p in out["pairs"]]) for k in FIGURES}
    return out


def _med(values):
    v = [x for x in values if x is not None]
    return float(np.median(v)) if v else None


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def render(m: dict) -> list[str]:
    """Markdown lines: the medians on / off and of the differences."""
    rows = []
    for k, (label, _) in FIGURES.items():
        lo_hi = m["range"][k]
        rows.append(f"| {label} | {_f(m['off'][k], 2)} | {_f(m['on'][k], 2)} | "
                    f"**{_f(m['median'][k], 2)}** | "
                    f"{'-' if lo_hi is None else f'{lo_hi[0]:,.2f}..{lo_hi[1]:,.2f}'} |")
    return ["| us | metrics off (median) | metrics on, scraped every 1 s (median) | "
            "on - off, median of pairs | on - off, range |", "|---|---|---|---|---|", *rows,
            "", f"{len(m['pairs'])} pairs, order alternating; {m['scrapes']} scrapes, "
                "each answered with the nv_inference_* families."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--window-ms", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--max-trials", type=int, default=5)
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    args = p.parse_args(argv)
    out = BENCH / "out"
    out.mkdir(exist_ok=True)
    m = measure(args.model_repository, out, args.pairs, args.window_ms, args.warmup,
                args.max_trials, say=lambda t: print(t, file=sys.stderr, flush=True))
    print("\n".join(render(m) + [f"- {n}" for n in m["notes"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
