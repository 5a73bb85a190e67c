#!/usr/bin/env python3
"""What an ensemble costs per step, against calling its models one by one.

One server serves three identity python models (numpy-dict API, FP32 [1, 1024],
4 KiB) and `chain`, an ensemble of the three in a row. One caller, one request at a
time, in blocks of --block requests that alternate between

  ensemble   client.infer("chain", x)
  by hand    client.infer("s0", x) -> "s1" -> "s2", each output the next input

so that both see the same machine. The ensemble's overhead per step is
(p50 ensemble - p50 by hand) / 3 steps, taken between neighbouring blocks, then
its median over blocks and over --repeats repeats. By hand, the caller's outputs
go back in place (zero copy) as the ensemble's intermediate tensors do; the
ensemble adds one hop (caller -> ensemble worker) and its worker's client.

    python bench/ensemble_cost.py                  # about a minute on 2 cores
    python bench/ensemble_cost.py --block 200 --blocks 10 --repeats 3
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from shmserve_bench.harness import ServerProcess

STEPS = 3
IDENTITY = '''
class TritonPythonModel:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
'''
TENSOR = 'name: "{}" data_type: TYPE_FP32 dims: [ 1024 ]'


def write_repo(repo: Path) -> None:
    for i in range(STEPS):
        model = repo / f"s{i}"
        (model / "1").mkdir(parents=True)
        (model / "1" / "model.py").write_text(IDENTITY)
        (model / "config.pbtxt").write_text(
            f'backend: "python"\nmax_batch_size: 8\ninput [ {{ {TENSOR.format("INPUT0")} }} ]\n'
            f'output [ {{ {TENSOR.format("OUTPUT0")} }} ]\ndynamic_batching {{ }}\n')
    steps = ",\n".join(
        f'{{ model_name: "s{i}" input_map {{ key: "INPUT0" value: "{"INPUT0" if i == 0 else f"t{i}"}" }} '
        f'output_map {{ key: "OUTPUT0" value: "{"OUTPUT0" if i == STEPS - 1 else f"t{i + 1}"}" }} }}'
        for i in range(STEPS))
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 8\ninput [ {{ {TENSOR.format("INPUT0")} }} ]\n'
        f'output [ {{ {TENSOR.format("OUTPUT0")} }} ]\n'
        f"ensemble_scheduling {{ step [\n{steps}\n] }}\n")


def p50_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000


def one_repeat(client, x, block: int, blocks: int) -> dict:
    def ensemble():
        return client.infer("chain", [x])["OUTPUT0"]

    def by_hand():
        y = x
        for i in range(STEPS):
            y = client.infer(f"s{i}", [y])["OUTPUT0"]
        return y

    np.testing.assert_array_equal(ensemble(), by_hand())
    per_block = {"ensemble": [], "by hand": []}
    for b in range(blocks):
        order = (("ensemble", ensemble), ("by hand", by_hand))
        for name, call in order if b % 2 == 0 else order[::-1]:
            samples = []
            for _ in range(block):
                start = time.perf_counter_ns()
                call()
                samples.append(time.perf_counter_ns() - start)
            per_block[name].append(p50_us(samples))
    step = [(e - h) / STEPS for e, h in zip(per_block["ensemble"], per_block["by hand"])]
    return {"ensemble": statistics.median(per_block["ensemble"]),
            "by hand": statistics.median(per_block["by hand"]),
            "per step": statistics.median(step)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shmserve-ensemble-cost-"))
    write_repo(work / "repo")
    server = ServerProcess(work / "repo", log_path=work / "server.log", name_prefix="bench-")
    try:
        server.start()
        with server.client(arena_bytes=16 << 20) as client:
            x = np.random.default_rng(0).standard_normal((1, 1024)).astype(np.float32)
            runs = [one_repeat(client, x, args.block, args.blocks) for _ in range(args.repeats)]
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    fig = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"identity 4 KiB, {STEPS} steps, one caller; median of {args.repeats} repeats of "
          f"{args.blocks} alternating blocks of {args.block} requests")
    print(f"  ensemble p50        {fig['ensemble']:8.1f} us")
    print(f"  by hand p50         {fig['by hand']:8.1f} us  ({STEPS} client calls)")
    print(f"  overhead per step   {fig['per step']:8.1f} us  ((ensemble - by hand) / {STEPS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
