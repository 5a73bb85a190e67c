#!/usr/bin/env python3
"""What the Python client itself costs per request, without a benchmark harness.

    python bench/client_cost.py                 # about 1 minute
    python bench/client_cost.py --seconds 2 --rounds 1

The suite's "client CPU" (run_all.py) is its client processes: the Python client plus the
harness's own bookkeeping (a future, a callback, a queue hand-off and a record per
request). Here one process runs the plainest loops an application would write against
a private server started in its own session (as a service runs), and divides its own
CPU time (user + system, os.times) by the requests answered:

  sync        client.infer() in a loop, 1 request in flight: the wait's spin counts as
              CPU, so this is close to the round trip by design;
  sync, no spin  the same with Client(spin_us=0): the client's work and its sleeps' cost;
  submit K    K requests in flight through client.submit(), each result released in a
              done-callback that submits the next (the futures poller collects them).

identity FP32 [1, 1024] and mlp FP32 [1, 256]. Rounds alternate the cases; the report
gives the median over rounds. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latency as L  # noqa: E402  (bench/latency.py: the private server)

ROOT = Path(__file__).resolve().parent.parent
INPUTS = {"identity": (1, 1024), "mlp": (1, 256)}


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def sync_loop(client, model: str, x: np.ndarray, seconds: float) -> tuple[int, float]:
    n, c0, end = 0, cpu_s(), time.monotonic() + seconds
    while time.monotonic() < end:
        client.infer(model, [x]).release()
        n += 1
    return n, cpu_s() - c0


def timed_loop(client, model: str, x: np.ndarray, n: int) -> np.ndarray:
    """n client.infer() calls one after the other, each timed from call to return
    (ns), as shmserve_latency times the C++ client's: no harness around them."""
    took = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        client.infer(model, [x]).release()
        took[i] = clock() - t0
    return took


def submit_loop(client, model: str, x: np.ndarray, seconds: float, k: int) -> tuple[int, float]:
    """k in flight; each answer's callback submits the next until the time is up."""
    done = threading.Semaphore(0)
    count = [0]
    end = time.monotonic() + seconds

    def finished(f):
        f.result().release()
        count[0] += 1
        if time.monotonic() < end:
            client.submit(model, [x]).add_done_callback(finished)
        else:
            done.release()

    c0 = cpu_s()
    for _ in range(k):
        client.submit(model, [x]).add_done_callback(finished)
    for _ in range(k):
        done.acquire()
    return count[0], cpu_s() - c0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per case and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-flight", type=int, nargs="+", default=[8, 32])
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    args = p.parse_args(argv)
    from shmserve.client import Client

    L.ensure_models(args.model_repository)
    (ROOT / "bench" / "out").mkdir(exist_ok=True)
    server = L.bench_server(args.model_repository, ROOT / "bench" / "out" / "client_cost.log", None)
    results: dict[tuple, list] = {}
    try:
        server.start(timeout=60)
        spinning = Client(server.name, arena_bytes=16 << 20)
        still = Client(server.name, arena_bytes=16 << 20, spin_us=0)
        rng = np.random.default_rng(0)
        for r in range(args.rounds):
            for model, shape in INPUTS.items():
                x = rng.random(shape, dtype=np.float32)
                cases = [("sync", lambda: sync_loop(spinning, model, x, args.seconds)),
                         ("sync, no spin", lambda: sync_loop(still, model, x, args.seconds))]
                cases += [(f"submit {k}", lambda k=k: submit_loop(spinning, model, x, args.seconds, k))
                          for k in args.in_flight]
                for name, run in cases:
                    if r == 0 and name == "sync":
                        run()  # warm-up: first calls, plans, pages
                    n, cpu = run()
                    results.setdefault((model, name), []).append((n / args.seconds, cpu / n * 1e6))
                    print(f"round {r + 1} {model:8s} {name:14s} {n / args.seconds:9,.0f} req/s  "
                          f"client CPU {cpu / n * 1e6:6.1f} us/req", file=sys.stderr, flush=True)
        spinning.close()
        still.close()
    finally:
        for note in L.stop_server(server):
            print("note:", note, file=sys.stderr)
    print(f"\n| model | case | req/s | client CPU us/req | (median of {args.rounds}) |")
    print("|---|---|---|---|---|")
    for (model, name), rows in results.items():
        print(f"| {model} | {name} | {statistics.median(r[0] for r in rows):,.0f} | "
              f"**{statistics.median(r[1] for r in rows):.1f}** | "
              f"{min(r[1] for r in rows):.1f}..{max(r[1] for r in rows):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
