#!/usr/bin/env python3
"""Batch sizes and queue times under each scheduling policy (issue 11).

One server serves one python model per policy. Each model's execute() sleeps a fixed
cost per batch plus a cost per row (--batch-us, --row-us): the shape of a model bound
by an accelerator or a memory-bound kernel, where batching pays, and a sleep leaves the
two cores to the callers, the batcher and the server (a busy loop would measure the
machine instead of the policy). The models take turns: for each, --callers closed-loop
callers (threads, one Client each, the same for every policy) run --seconds after --warmup-s. Reported per policy:

  requests/batch   the distribution, from the server's statistics (shmserve's
                   batch_requests: requests per execution, taken as a difference
                   around the window)
  queue us         per request, from its own timestamps: DEQUEUE (the batcher took
                   it) -> BATCHED (handed to an instance), p50/p99
  latency us       the caller's round trip, p50/p99; throughput

Policies (config.pbtxt fragments, max_batch_size 16, one instance):
  default          no dynamic_batching: Triton's default scheduler, one request a batch
  dynamic          dynamic_batching {}: whatever waits when an instance is free
  delay 2ms        max_queue_delay_microseconds 2000
  preferred 4,8    preferred_batch_size [4, 8], delay 2000
  priority         priority_levels 2; a quarter of the callers send priority 1, the
                   rest the default 2: queue times per level
  seq direct       sequence_batching direct, sequences of --seq-len requests
  seq oldest       sequence_batching oldest, max_candidate_sequences 16, delay 1000

Nothing is asserted: this shows what each policy does to batch sizes and queueing,
in one run, on one machine.

    python bench/policies.py                       # about a minute
    python bench/policies.py --callers 32 --seconds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from shmserve_bench.harness import ServerProcess  # noqa: E402
from shmserve.protocol import Timestamp  # noqa: E402

MODEL = '''
import time

class TritonPythonModel:
    def initialize(self, args):
        import json
        p = json.loads(args["model_config"])["parameters"]
        self.batch_s = float(p["batch_us"]["string_value"]) / 1e6
        self.row_s = float(p["row_us"]["string_value"]) / 1e6

    def execute(self, inputs):
        x = inputs["INPUT0"]
        time.sleep(self.batch_s + self.row_s * len(x))
        return {"OUTPUT0": x}
'''

POLICIES = {  # label -> (model name, scheduling fragment)
    "default": ("p_default", ""),
    "dynamic": ("p_dynamic", "dynamic_batching { }"),
    "delay 2ms": ("p_delay", "dynamic_batching { max_queue_delay_microseconds: 2000 }"),
    "preferred 4,8": ("p_preferred", "dynamic_batching { preferred_batch_size: [4, 8] "
                      "max_queue_delay_microseconds: 2000 }"),
    "priority": ("p_priority", "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"),
    "seq direct": ("p_direct", "sequence_batching { max_sequence_idle_microseconds: 5000000 "
                   "direct { } }"),
    "seq oldest": ("p_oldest", "sequence_batching { max_sequence_idle_microseconds: 5000000 "
                   "oldest { max_candidate_sequences: 16 max_queue_delay_microseconds: 1000 } }"),
}


def write_repo(repo: Path, batch_us: int, row_us: int) -> None:
    for name, fragment in POLICIES.values():
        d = repo / name
        (d / "1").mkdir(parents=True)
        (d / "1" / "model.py").write_text(MODEL)
        (d / "config.pbtxt").write_text("\n".join([
            f'name: "{name}"', 'backend: "python"', "max_batch_size: 16",
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]',
            'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]',
            'instance_group [ { count: 1 kind: KIND_CPU } ]',
            f'parameters {{ key: "batch_us" value {{ string_value: "{batch_us}" }} }}',
            f'parameters {{ key: "row_us" value {{ string_value: "{row_us}" }} }}',
            fragment]) + "\n")


def batch_requests(client, model: str) -> dict[int, int]:
    (stat,) = client.statistics(model)
    return {int(k): int(v) for k, v in stat["shmserve"]["batch_requests"].items()}


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_policy(clients: list, label: str, args) -> dict:
    model, fragment = POLICIES[label]
    sequences = fragment.startswith("sequence")
    x = np.ones((1, 16), np.float32)
    stop_warm, stop = threading.Event(), threading.Event()
    records: list[tuple[int, float, float]] = []  # (priority, latency us, queue us)
    lock = threading.Lock()
    seq_ids = iter(range(1, 1 << 40))

    def caller(i: int) -> None:
        c = clients[i]
        priority = 1 if label == "priority" and i % 4 == 0 else 0
        mine, step, seq = [], 0, 0
        while not stop.is_set():
            kw = {}
            if sequences:
                if step == 0:
                    with lock:
                        seq = next(seq_ids)
                kw = dict(sequence_id=seq, sequence_start=step == 0,
                          sequence_end=step == args.seq_len - 1)
                step = (step + 1) % args.seq_len
            t0 = time.perf_counter_ns()
            r = c.infer(model, [x], priority=priority, **kw)
            t1 = time.perf_counter_ns()
            if stop_warm.is_set():
                t = r.timestamps_ns
                mine.append((priority or 2, (t1 - t0) / 1e3,
                             (t[Timestamp.BATCHED] - t[Timestamp.DEQUEUE]) / 1e3))
            r.release()
        with lock:
            records.extend(mine)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.callers)]
    for t in threads:
        t.start()
    time.sleep(args.warmup_s)
    before = batch_requests(clients[0], model)
    stop_warm.set()
    t_start = time.perf_counter()
    time.sleep(args.seconds)
    after = batch_requests(clients[0], model)
    elapsed = time.perf_counter() - t_start
    stop.set()
    for t in threads:
        t.join(30)
    sizes = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    sizes = {n: k for n, k in sorted(sizes.items()) if k > 0}
    executions = sum(sizes.values())
    lat = [r[1] for r in records]
    out = {"model": model, "requests": len(records), "throughput": len(records) / elapsed,
           "batches": executions,
           "mean_requests_per_batch": (sum(n * k for n, k in sizes.items()) / executions
                                       if executions else float("nan")),
           "requests_per_batch": sizes,
           "latency_us": {"p50": pct(lat, 50), "p99": pct(lat, 99)},
           "queue_us": {"p50": pct([r[2] for r in records], 50),
                        "p99": pct([r[2] for r in records], 99)}}
    if label == "priority":
        out["queue_us_by_level"] = {
            level: {"p50": pct([r[2] for r in records if r[0] == level], 50),
                    "p99": pct([r[2] for r in records if r[0] == level], 99),
                    "requests": sum(1 for r in records if r[0] == level)}
            for level in (1, 2)}
    return out


def histogram_text(sizes: dict[int, int]) -> str:
    total = sum(sizes.values()) or 1
    return " ".join(f"{n}:{100 * k / total:.0f}%" for n, k in sizes.items() if 100 * k / total >= 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0, help="measured window per policy")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--batch-us", type=int, default=2000, help="the model's sleep per batch")
    ap.add_argument("--row-us", type=int, default=100, help="the model's sleep per row")
    ap.add_argument("--seq-len", type=int, default=8, help="requests per sequence")
    ap.add_argument("--only", nargs="*", choices=list(POLICIES), help="these policies only")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    labels = args.only or list(POLICIES)
    with tempfile.TemporaryDirectory(prefix="shmserve-policies-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        write_repo(repo, args.batch_us, args.row_us)
        server = ServerProcess(repo, log_path=Path(tmp) / "server.log")
        results = {}
        try:
            server.start()
            clients = [server.client(arena_bytes=1 << 20) for _ in range(args.callers)]
            for label in labels:
                print(f"# {label} ...", file=sys.stderr, flush=True)
                results[label] = run_policy(clients, label, args)
        finally:
            problems = server.teardown()
            if problems:
                print("teardown: " + "; ".join(problems), file=sys.stderr)
    try:
        load = open("/proc/loadavg").read().split()[0]
    except OSError:
        load = "?"
    print(f"\n{args.callers} callers, model sleeps {args.batch_us} us a batch + {args.row_us} us a "
          f"row, {args.seconds:g} s per policy, load average {load}\n")
    print("| policy | infer/s | batches | requests/batch mean | distribution (requests:share) "
          "| queue p50 / p99 us | latency p50 / p99 us |")
    print("|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['throughput']:.0f} | {r['batches']} | {r['mean_requests_per_batch']:.1f} "
              f"| {histogram_text(r['requests_per_batch'])} "
              f"| {r['queue_us']['p50']:.0f} / {r['queue_us']['p99']:.0f} "
              f"| {r['latency_us']['p50']:.0f} / {r['latency_us']['p99']:.0f} |")
    if "priority" in results:
        levels = results["priority"]["queue_us_by_level"]
        print("\npriority: queue p50 / p99 us by level: " + ", ".join(
            f"level {lv} ({v['requests']} requests) {v['p50']:.0f} / {v['p99']:.0f}"
            for lv, v in levels.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "load": load, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
