#!/usr/bin/env python3
"""Interleaved A/B of the identity 4 KiB round trip between two source trees.

Each tree serves its own `identity` model with its own code (a server per tree, both
up for the whole run); rounds alternate which tree is measured first (A B, B A, ...),
each measurement a fresh client process of that tree: warm-up, then --requests timed
`infer("identity", [1, 1024] FP32)` calls, one at a time (copy=False, released). The
report is the median over rounds of each tree's p50 and p99, and of the per-round
ratio B/A of p50s, so a drift of the machine during the run hits both sides alike.

    python bench/ab_latency.py --a /tmp/main-tree --b . --rounds 9 --requests 5000

A tree needs its C core built (`/work/build_core.sh` in it, or setup.py). Nothing here
asserts on time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = r"""
import json, sys, time
import numpy as np
import shmserve
name, n, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with shmserve.Client(name) as c:
    x = np.ones((1, 1024), np.float32)
    for _ in range(warmup):
        c.infer("identity", [x]).release()
    t = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = c.infer("identity", [x])
        t.append(time.perf_counter_ns() - t0)
        r.release()
    assert (c.infer("identity", [x], copy=True)["OUTPUT0"] == x).all()
t.sort()
print(json.dumps({"p50": t[len(t) // 2] / 1e3, "p99": t[int(len(t) * 0.99)] / 1e3}))
"""


def env_of(tree: Path, runtime: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "SHMSERVE_RUNTIME_DIR": str(runtime),
            "PYTHONDONTWRITEBYTECODE": "1"}


def serve(tree: Path, name: str, runtime: Path, log: Path) -> subprocess.Popen:
    """The tree's server on a repository of its own `identity` model alone."""
    repo = log.parent / f"repo-{name}"
    shutil.copytree(tree / "model_repository" / "identity", repo / "identity")
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                             str(repo), "--name", name],
                            env=env_of(tree, runtime), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    sock = runtime / f"{name}.sock"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock))
                return proc
            except OSError:
                time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server of {tree} did not start:\n{log.read_text()[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="baseline source tree")
    p.add_argument("--b", type=Path, required=True, help="candidate source tree")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=1000)
    args = p.parse_args()
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    results: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="shms-ab-") as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        servers = {}
        try:
            for key, tree in trees.items():
                servers[key] = serve(tree, f"ab{key}{os.getpid()}", runtime, Path(tmp) / f"{key}.log")
            for r in range(args.rounds):
                for key in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    out = subprocess.run(
                        [sys.executable, "-c", MEASURE, f"ab{key}{os.getpid()}", str(args.requests),
                         str(args.warmup)], env=env_of(trees[key], runtime), capture_output=True,
                        text=True, check=True)
                    results[key].append(json.loads(out.stdout))
                print(f"round {r + 1}: A p50 {results['A'][-1]['p50']:.1f} us, "
                      f"B p50 {results['B'][-1]['p50']:.1f} us", file=sys.stderr)
        finally:
            for proc in servers.values():
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in servers.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def med(key, stat):
        return statistics.median(x[stat] for x in results[key])

    ratios = [b["p50"] / a["p50"] for a, b in zip(results["A"], results["B"])]
    report = {"A": str(trees["A"]), "B": str(trees["B"]), "rounds": args.rounds,
              "requests": args.requests,
              "A_p50_us": med("A", "p50"), "B_p50_us": med("B", "p50"),
              "A_p99_us": med("A", "p99"), "B_p99_us": med("B", "p99"),
              "B_over_A_p50_median": statistics.median(ratios),
              "B_over_A_p50_range": [min(ratios), max(ratios)]}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
