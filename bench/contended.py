#!/usr/bin/env python3
"""The 1-caller round trip on a busy machine, with and without the server's CPU watch.

    python bench/contended.py                    # about 3 minutes
    python bench/contended.py --rounds 2 --requests 5000

Two private servers, each started in its own session as a service runs: one with the
default CPU watch (`--cpu-watch-ms 100`), one with `--cpu-watch-ms 0` (its waiters spin
whatever the load, as before the watch). Each round measures each server in turn,
the order alternating: sync identity 4 KiB calls from this process, first quiet, then
with one CPU-bound process per usable CPU (run_all.py's contended scenario: normal
priority, started from this process's session; `--neighbours own-session` starts them
in a session of their own, as a neighbour service would be). Every request is timed; the report
gives each round's p50 and p99 and the medians over rounds, and whether the watch
called the CPUs crowded. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latency as L  # noqa: E402  (bench/latency.py: the private server)
from shmserve_bench.contention import BusyLoad  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = {"watch (default)": [], "no watch (--cpu-watch-ms 0)": ["--cpu-watch-ms", "0"]}


def timed_calls(client, x: np.ndarray, n: int) -> tuple[float, float]:
    """p50 and p99 in us of n sync identity calls."""
    t = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        client.infer("identity", [x]).release()
        t[i] = time.perf_counter_ns() - t0
    p50, p99 = np.percentile(t, [50, 99]) / 1000
    return float(p50), float(p99)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20000, help="per case, phase and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--neighbours", choices=["caller-session", "own-session"],
                   default="caller-session", help="the busy processes' session")
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    args = p.parse_args(argv)
    from shmserve.client import Client

    L.ensure_models(args.model_repository)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    x = np.random.default_rng(0).random((1, 1024), dtype=np.float32)
    rows: dict[str, list[dict]] = {case: [] for case in CASES}
    for r in range(args.rounds):
        order = list(CASES) if r % 2 == 0 else list(reversed(CASES))
        for case in order:
            server = L.bench_server(args.model_repository, out / "contended.log", None)
            server.args += CASES[case]
            try:
                server.start(timeout=60)
                with Client(server.name, arena_bytes=16 << 20) as client:
                    timed_calls(client, x, 2000)  # warm-up: plans, pages, the spin's history
                    quiet = timed_calls(client, x, args.requests)
                    with BusyLoad(own_session=args.neighbours == "own-session") as busy:
                        time.sleep(0.3)  # a few of the watch's intervals
                        loaded = timed_calls(client, x, args.requests)
                        crowded = client.server_status()["cpu_watch"]["crowded"]
            finally:
                for note in L.stop_server(server):
                    print("note:", note, file=sys.stderr)
            row = {"quiet": quiet, "busy": loaded, "crowded": crowded, "procs": busy.count}
            rows[case].append(row)
            print(f"round {r + 1} {case:28s} quiet p50 {quiet[0]:6.1f} p99 {quiet[1]:7.1f} | "
                  f"{busy.count} busy: p50 {loaded[0]:6.1f} p99 {loaded[1]:8.1f} us"
                  f"{'  (crowded)' if crowded else ''}", file=sys.stderr, flush=True)
    med = lambda rs, phase, k: statistics.median(row[phase][k] for row in rs)  # noqa: E731
    print(f"\n| server | quiet p50 | quiet p99 | busy p50 | busy p99 | busy p50 range | "
          f"rounds crowded | (us, median of {args.rounds}; busy processes in the "
          f"{args.neighbours}) |")
    print("|---|---|---|---|---|---|---|---|")
    for case, rs in rows.items():
        print(f"| {case} | {med(rs, 'quiet', 0):.1f} | {med(rs, 'quiet', 1):.1f} | "
              f"**{med(rs, 'busy', 0):.1f}** | **{med(rs, 'busy', 1):.1f}** | "
              f"{min(r['busy'][0] for r in rs):.1f}..{max(r['busy'][0] for r in rs):.1f} | "
              f"{sum(r['crowded'] for r in rs)}/{len(rs)} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
