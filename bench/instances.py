#!/usr/bin/env python3
"""Instances (issue 11): 2 instances x 1 thread against 1 instance x 2 threads, and
balanced against greedy (Triton's rule) sharing of the queue, on a compute-bound model.

    .venv/bin/python bench/instances.py            # about a minute on 2 cores
    .venv/bin/python bench/instances.py --hidden 512 --window-ms 500   # quicker look

The model (written here with onnx.helper): X [N, 256] FP32 -> MatMul 256x1024 -> Relu ->
MatMul 1024x1024 -> Relu -> MatMul 1024x1024 -> Relu -> MatMul 1024x256: about 5 MFLOP a
row, ~1 ms for a batch of 16 on one core. max_batch_size 32, dynamic_batching with no
queue delay. Load: 32 closed-loop callers from 2 client processes (shmserve_bench),
1 s windows after 0.5 s warm-up until 3 agree within 10 % (at most --max-trials).

Configurations, one server at a time:
  2x1 balanced   instance_group count 2, intra_op_thread_count 1 (the default)
  2x1 greedy     the same with shmserve.instance_balancing "greedy"
  1x2            instance_group count 1, intra_op_thread_count 2

Ceiling: bare onnxruntime on the same model.onnx, timed (median) at the batch sizes
that configuration formed (its statistics' batch histogram), sequential: for 2x1 one
session of 1 thread, its throughput doubled (two cores, perfect scaling); for 1x2 one
session of 2 threads. Ratios are within this run; nothing is asserted on time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import latency as L  # noqa: E402  (private server start/stop, machine load)
from shmserve_bench import BenchConfig, run_benchmark  # noqa: E402
from shmserve_bench.ceiling import ort_ceiling  # noqa: E402

WIDTH = 256
CONFIGS = {  # label -> (instances, intra_op threads, balancing)
    "2x1 balanced": (2, 1, "balanced"),
    "2x1 greedy": (2, 1, "greedy"),
    "1x2": (1, 2, "balanced"),
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_model(path: Path, hidden: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    dims = [WIDTH, hidden, hidden, hidden, WIDTH]
    nodes, inits, x = [], [], "INPUT0"
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        last = i == len(dims) - 2
        y = "OUTPUT0" if last else f"H{i}"
        nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [y if last else f"M{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"M{i}"], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "instances_mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["N", WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_repo(repo: Path, onnx_path: Path, instances: int, threads: int, balancing: str) -> None:
    d = repo / "heavy"
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.onnx").write_bytes(onnx_path.read_bytes())
    (d / "config.pbtxt").write_text(f'''name: "heavy"
backend: "onnxruntime"
max_batch_size: 32
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
dynamic_batching {{ }}
parameters {{ key: "intra_op_thread_count" value {{ string_value: "{threads}" }} }}
parameters {{ key: "shmserve.instance_balancing" value {{ string_value: "{balancing}" }} }}
''')


def measure(args, label: str, onnx_path: Path, work: Path) -> dict:
    instances, threads, balancing = CONFIGS[label]
    repo = work / label.replace(" ", "_")
    write_repo(repo, onnx_path, instances, threads, balancing)
    server = L.bench_server(repo, work / f"{repo.name}.log", None)
    try:
        server.start(timeout=60)
        cfg = BenchConfig(model="heavy", url=f"shm://{server.name}", concurrency=[args.callers],
                          processes=2, measurement_interval_s=args.window_ms / 1000.0,
                          warmup_s=0.5, max_trials=args.max_trials, stability_pct=10.0)
        (tr,) = run_benchmark(cfg)
        (lv,) = tr.levels
    finally:
        notes = L.stop_server(server)
    hist = {int(k): int(v) for k, v in ((lv.server_stats or {}).get("batch_requests") or {}).items()}
    rows = sum(b * n for b, n in hist.items())
    ceil = ort_ceiling(onnx_path, hist, threads, args.ceiling_s) if hist else {"throughput": None}
    if ceil["throughput"] and instances > 1:
        ceil["throughput"] *= instances  # one session per core, perfect scaling assumed
    lat = lv.summary.get("latency_us", {})
    return {"label": label, "throughput": lv.summary.get("throughput"), "p50_us": lat.get("p50"),
            "p99_us": lat.get("p99"), "stable": lv.stable, "errors": lv.summary.get("errors"),
            "mean_batch": rows / max(1, sum(hist.values())), "hist": hist, "ceiling": ceil,
            "notes": notes + ([tr.error] if tr.error else [])}


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    ap.add_argument("--callers", type=int, default=32)
    ap.add_argument("--window-ms", type=int, default=1000)
    ap.add_argument("--max-trials", type=int, default=8)
    ap.add_argument("--ceiling-s", type=float, default=3.0, help="time budget of each ceiling")
    args = ap.parse_args()
    load_before = L.background_load()
    results = []
    with tempfile.TemporaryDirectory(prefix="shms-instances-") as tmp:
        work = Path(tmp)
        onnx_path = work / "heavy.onnx"
        write_model(onnx_path, args.hidden)
        for label in CONFIGS:
            say(f"  {label} ...")
            results.append(measure(args, label, onnx_path, work))
    by = {r["label"]: r for r in results}
    print(f"# Instances: {args.callers} closed-loop callers, MLP 256-{args.hidden}x3-256, "
          "max_batch_size 32, no queue delay\n")
    mi = L.machine_info()
    print(f"machine: {mi['nproc']} CPUs ({mi['cpu_model']}), commit {mi['shmserve_commit']}; "
          f"background load before: {load_before}; after: {L.background_load()}\n")
    print("| configuration | infer/s | p50 us | p99 us | mean batch | batch sizes (batches) "
          "| bare ORT ceiling infer/s | of ceiling |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for r in results:
        hist = ", ".join(f"{b}:{n}" for b, n in sorted(r["hist"].items(), key=lambda kv: -kv[1])[:5])
        c = r["ceiling"]["throughput"]
        print(f"| {r['label']} | {fmt(r['throughput'])} | {fmt(r['p50_us'])} | {fmt(r['p99_us'])} "
              f"| {r['mean_batch']:.1f} | {hist} | {fmt(c)} "
              f"| {fmt(r['throughput'] / c if c and r['throughput'] else None, '.2f')} |")
    print()

    def ratio(a, b, what):
        x, y = by[a]["throughput"], by[b]["throughput"]
        print(f"- {what}: {a} / {b} = {fmt(x / y if x and y else None, '.2f')}")

    ratio("2x1 balanced", "2x1 greedy", "balanced over greedy")
    ratio("2x1 balanced", "1x2", "2 instances x 1 thread over 1 instance x 2 threads")
    ratio("2x1 greedy", "1x2", "greedy 2x1 over 1x2")
    for r in results:
        if r["ceiling"].get("median_batch_s"):
            times = r["ceiling"]["median_batch_s"]
            ms = ", ".join(f"{b}: {t * 1e3:.2f}" for b, t in sorted(times.items())
                           if b in (1, 8, 16, 32) or len(times) <= 4)
            print(f"- bare ORT batch ms ({r['label']}, {CONFIGS[r['label']][1]} thread(s)): {ms}")
        if not r["stable"]:
            print(f"- {r['label']}: not stable within 10 % in {args.max_trials} windows")
        for n in r["notes"]:
            print(f"- {r['label']}: {n}")


if __name__ == "__main__":
    main()
