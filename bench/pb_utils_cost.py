#!/usr/bin/env python3
"""What Triton's python model API costs per request, against the numpy-dict API.

One server serves two identity models that differ only in their API: `identity`
(the bundled numpy-dict model: execute(inputs) -> outputs on the whole batch) and
`identity_pb` (the same config, model.py written with triton_python_backend_utils:
execute(requests) -> one InferenceResponse per request), FP32 [1, 1024] (4 KiB),
interleaved so that both see the same machine (the first model of each repeat
alternating too), in two scenarios:

  1 caller     one request at a time, in blocks of --block requests per model, the
               models taking turns (each model's worker stays warm within its block,
               as under a steady stream). Per request: the round trip, and the
               worker's part of it, COMPUTE_START -> COMPLETE of the request's own
               timestamps (inputs viewed, model run, outputs checked and written,
               answer published): the difference between the models there is the
               compatibility layer alone. Each difference is taken between the
               medians of neighbouring blocks, then its median over the blocks (the
               machine's drift cancelled block by block);
  N in flight  one client keeps --in-flight requests submitted at once, so the
               batcher forms batches of several: wall time per request (blocks too).

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
from shmserve.protocol import Timestamp
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


def one_caller(client, model: str, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Round trips and worker parts (ns) of n requests in a row."""
    lat, worker = np.empty(n, np.int64), np.empty(n, np.int64)
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        out = client.infer(model, {"INPUT0": x})
        lat[i] = clock() - t0
        stamps = out.timestamps_ns
        worker[i] = stamps[Timestamp.COMPLETE] - stamps[Timestamp.COMPUTE_START]
        out.release()
    return lat, worker


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
    n_blocks = max(1, args.requests // args.block)
    blocks = {m: {"round_trip_us": [], "worker_us": [], "in_flight_us": []} for m in MODELS}
    for _ in range(n_blocks):
        for m in order:
            lat, worker = one_caller(client, m, x, args.block)
            blocks[m]["round_trip_us"].append(float(np.median(lat)) / 1000)
            blocks[m]["worker_us"].append(float(np.median(worker)) / 1000)
    for _ in range(n_blocks):
        for m in order:
            blocks[m]["in_flight_us"].append(in_flight(client, m, x, args.block, args.in_flight) / 1000)
    out = {m: {k: float(np.median(v)) for k, v in blocks[m].items()} for m in MODELS}
    out["cost"] = {k: float(np.median(np.subtract(blocks["identity_pb"][k], blocks["identity"][k])))
                   for k in blocks["identity"]}
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
                f"{m} {runs[-1][m]['round_trip_us']:.1f} us (worker "
                f"{runs[-1][m]['worker_us']:.2f} us)" for m in MODELS)
                + f", cost {runs[-1]['cost']['worker_us']:+.2f} us", file=sys.stderr)
    finally:
        notes = server.teardown()
        shutil.rmtree(work, ignore_errors=True)
    if notes:
        print("server teardown:", notes, file=sys.stderr)

    def median(model: str, key: str) -> float:
        return statistics.median(run[model][key] for run in runs)

    def cost(key: str) -> float:
        return statistics.median(run["cost"][key] for run in runs)

    rows = [("round trip, 1 caller", "round_trip_us"),
            ("worker part, 1 caller (COMPUTE_START -> COMPLETE)", "worker_us"),
            (f"wall per request, {args.in_flight} in flight", "in_flight_us")]
    lines = [f"# pb_utils API vs numpy-dict API, identity FP32 [1, 1024], "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", f"{args.repeats} repeats x {args.requests} requests per model, interleaved in "
             f"blocks of {args.block}; us per request, medians over blocks then repeats; the "
             "last column is the median of the differences between neighbouring blocks.", "",
             "| what | numpy-dict | pb_utils | pb_utils - numpy-dict |", "|---|---:|---:|---:|"]
    for label, key in rows:
        lines.append(f"| {label} | {median('identity', key):.2f} | {median('identity_pb', key):.2f} "
                     f"| {cost(key):+.2f} |")
    layer = cost("worker_us")
    lines += ["", f"Compatibility layer (worker part, pb_utils - numpy-dict): {layer:+.2f} us per "
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
