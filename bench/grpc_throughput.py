"""Closed-loop throughput of tritonclient.grpc.aio against KServe v2 gRPC servers given
by URL (shmserve's front, Triton from ../shared/peers): `--concurrency` requests in
flight on one channel, each sent as soon as the previous one returned, the MLP
(FP32 [1, 256] -> [1, 16]) by default. Windows of `--seconds` alternate between the
servers (`--windows` each), so that a load that changes during the run weighs on both;
prints each server's median infer/s and p50 over its windows, and their ratio.

    python bench/grpc_throughput.py --url shmserve=127.0.0.1:8001 --url triton=127.0.0.1:18001
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np


async def window(url: str, model: str, concurrency: int, seconds: float, warmup: float,
                 shape: list) -> tuple[float, float]:
    """(infer/s, p50 us) of one window after `warmup` seconds; every answer's shape checked."""
    import tritonclient.grpc.aio as tga

    client = tga.InferenceServerClient(url)
    rng = np.random.default_rng(0)
    inputs = []
    for _ in range(8):
        inp = tga.InferInput("INPUT0", shape, "FP32")
        inp.set_data_from_numpy(rng.standard_normal(shape).astype(np.float32))
        inputs.append(inp)
    outputs = [tga.InferRequestedOutput("OUTPUT0")]
    times: list[float] = []
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def caller(k: int):
        i = k
        while (now := time.perf_counter()) < end:
            got = await client.infer(model, [inputs[i % len(inputs)]], outputs=outputs)
            if got.as_numpy("OUTPUT0") is None:
                raise SystemExit(f"{url}: no OUTPUT0 in the answer")
            if now >= measure_from:
                times.append(time.perf_counter() - now)
            i += 1

    try:
        await asyncio.gather(*(caller(k) for k in range(concurrency)))
    finally:
        await client.close()
    return len(times) / seconds, statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", required=True, metavar="NAME=HOST:PORT")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--shape", default="1,256")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--windows", type=int, default=3)
    args = ap.parse_args()
    urls = dict(u.split("=", 1) for u in args.url)
    shape = [int(d) for d in args.shape.split(",")]
    got: dict = {name: [] for name in urls}
    for w in range(args.windows):
        for name, url in urls.items():
            rate, p50 = asyncio.run(window(url, args.model, args.concurrency, args.seconds,
                                           args.warmup, shape))
            got[name].append((rate, p50))
            print(f"[{w + 1}] {name:10s} {rate:8.0f} infer/s  p50 {p50:8.0f} us", flush=True)
    names = list(urls)
    for name in names:
        print(f"{name:10s} median of {args.windows}: "
              f"{statistics.median(r for r, _ in got[name]):.0f} infer/s, "
              f"p50 {statistics.median(p for _, p in got[name]):.0f} us")
    if len(names) == 2:
        ratios = [a[0] / b[0] for a, b in zip(got[names[0]], got[names[1]])]
        print(f"{names[0]}/{names[1]} throughput: {statistics.median(ratios):.2f} "
              f"(per window: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
