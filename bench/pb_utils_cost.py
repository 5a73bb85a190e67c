#!/usr/bin/env python3
"""What Triton's python model API costs per request, against the numpy-dict API.

One server serves two identity models that differ only in their API: `identity`
(the bundled numpy-dict model: execute(inputs) -> outputs on the whole batch) and
`identity_pb` (the same config, model.py written with triton_python_backend_utils:
execute(requests) -> one InferenceResponse per request). They are measured
interleaved (blocks of --block requests, alternating, the first model of each repeat
alternating too), FP32 [1, 1024] (4 KiB), in two scenarios:

  1 caller     one request at a time: round trip per request (median), and the
               worker's own time per request (gather + model + check and scatter,
               from the server's statistics: compute_input + compute_infer +
               compute_output), whose difference is the compatibility layer alone;
  N in flight  one client keeps --in-flight requests submitted at once, so the
               batcher forms batches of several: wall time per request.

Each figure is the median over --repeats repeats. Nothing is asserted: the report
states the issue's target (the compatibility layer costs at most 5 us per request)
and whether this run met it.

    python bench/pb_utils_cost.py                      # about 1-2 minutes on 2 cores
    python bench/pb_utils_cost.py --requests 500 --repeats 3 --in-flight 8
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from shmserve_bench.harness import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TARGET_US = 5.0  # issue 10: the compatibility layer costs at most 5 us per request
MODELS = ("identity", "identity_pb")

IDENTITY_PB_CODE = '''"""identity_pb: OUTPUT0 = INPUT0, written with Triton's python model API."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", in_0.as_numpy())]))
        return responses
'''


def write_repository(repo: Path) -> None:
    src = ROOT / "model_repository" / "identity"
    for name in MODELS:
        (repo / name / "1").mkdir(parents=True)
        config = (src / "config.pbtxt").read_text().replace('name: "identity"', f'name: "{name}"')
        (repo / name / "config.pbtxt").write_text(config)
    shutil.copy(src / "1" / "model.py", repo / "identity" / "1" / "model.py")
    (repo / "identity_pb" / "1" / "model.py").write_text(IDENTITY_PB_CODE)


def worker_ns(client, model: str) -> tuple[int, int]:
    """(requests, ns) the worker spent on them: gather + model + check and scatter."""
    [stats] = client.statistics(model)
    inf = stats["inference_stats"]
    return (inf["compute_infer"]["count"],
            sum(inf[k]["ns"] for k in ("compute_input", "compute_infer", "compute_output")))


def one_caller(client, model: str, x: np.ndarray, n: int) -> list[int]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        out = client.infer(model, {"INPUT0": x})
        lat.append(time.perf_counter_ns() - t0)
        out.release()
    return lat


def in_flight(client, model: str, x: np.ndarray, n: int, depth: int) -> float:
    """Wall ns per request with `depth` requests submitted at a time."""
    t0 = time.perf_counter_ns()
    for _ in range(n // depth):
        futures = [client.submit(model, {"INPUT0": x}) for _ in range(depth)]
        for f in futures:
            f.result(30).release()
    return (time.perf_counter_ns() - t0) / (n // depth * depth)


def repeat(client, x: np.ndarray, args, first: int) -> dict:
    order = MODELS if first == 0 else MODELS[::-1]
    lat = {m: [] for m in MODELS}
    before = {m: worker_ns(client, m) for m in MODELS}
    for _ in range(max(1, args.requests // args.block)):
        for m in order:
            lat[m] += one_caller(client, m, x, args.block)
    after = {m: worker_ns(client, m) for m in MODELS}
    flight = {m: [] for m in MODELS}
    for _ in range(max(1, args.requests // args.block)):
        for m in order:
            flight[m].append(in_flight(client, m, x, args.block, args.in_flight))
    out = {}
    for m in MODELS:
        count = after[m][0] - before[m][0]
        out[m] = {"round_trip_us": float(np.median(lat[m])) / 1000,
                  "worker_us": (after[m][1] - before[m][1]) / max(count, 1) / 1000,
                  "in_flight_us": float(np.mean(flight[m])) / 1000}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000, help="timed requests per model and repeat")
    p.add_argument("--block", type=int, default=200, help="requests in a row before switching model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=500, help="untimed requests per model first")
    p.add_argument("--in-flight", type=int, default=8, help="requests at once in the second scenario")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pb-utils-cost-"))
    write_repository(work / "repo")
    server = ServerProcess(work / "repo", log_path=work / "server.log", name_prefix="bench-")
    runs = []
    try:
        server.start()
        client = server.client(arena_bytes=16 << 20)
        x = np.random.default_rng(0).standard_normal((1, 1024)).astype(np.float32)
        for m in MODELS:  # warm-up, and a check that both answer the same
            for _ in range(args.warmup):
                out = client.infer(m, {"INPUT0": x}, copy=True)
            if not np.array_equal(out["OUTPUT0"], x):
                raise SystemExit(f"model {m} answered wrong")
        for r in range(args.repeats):
            runs.append(repeat(client, x, args, r % 2))
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{m} {v['round_trip_us']:.1f} us (worker {v['worker_us']:.2f} us)"
                for m, v in runs[-1].items()), file=sys.stderr)
    finally:
        notes = server.teardown()
        shutil.rmtree(work, ignore_errors=True)
    if notes:
        print("server teardown:", notes, file=sys.stderr)

    def median(model: str, key: str) -> float:
        return statistics.median(run[model][key] for run in runs)

    def cost(key: str) -> float:  # per repeat, pb minus numpy; then the median
        return statistics.median(run["identity_pb"][key] - run["identity"][key] for run in runs)

    rows = [("round trip, 1 caller (median)", "round_trip_us"),
            ("worker time per request, 1 caller", "worker_us"),
            (f"wall per request, {args.in_flight} in flight", "in_flight_us")]
    lines = [f"# pb_utils API vs numpy-dict API, identity FP32 [1, 1024], "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", f"{args.repeats} repeats x {args.requests} requests per model, interleaved in "
             f"blocks of {args.block}; medians over repeats (us per request).", "",
             "| what | numpy-dict | pb_utils | pb_utils - numpy-dict |", "|---|---:|---:|---:|"]
    for label, key in rows:
        lines.append(f"| {label} | {median('identity', key):.2f} | {median('identity_pb', key):.2f} "
                     f"| {cost(key):+.2f} |")
    layer = cost("worker_us")
    lines += ["", f"Compatibility layer (worker time, pb_utils - numpy-dict): {layer:+.2f} us per "
              f"request; target <= {TARGET_US:g} us: {'met' if layer <= TARGET_US else 'NOT met'}."]
    report = "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}"
    (args.out / f"pb_utils_cost-{stamp}.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
         "layer_us": layer, "target_us": TARGET_US, "pid": os.getpid()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
