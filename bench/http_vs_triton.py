"""Round-trip latency of tritonclient.http (one keep-alive connection, concurrency 1,
binary tensor data) or tritonclient.grpc (one channel, raw contents) against KServe v2
servers given by URL: shmserve's fronts and the real Triton (../shared/peers,
`triton.sh start`). Same client, same model (identity, FP32 [1, n]), requests alternating
between the servers; prints medians and their ratio.

    python bench/http_vs_triton.py --url shmserve=127.0.0.1:8000 --url triton=127.0.0.1:18000
    python bench/http_vs_triton.py --protocol grpc \
        --url shmserve=127.0.0.1:8001 --url triton=127.0.0.1:18001
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


class Target:
    """One server's client and request (identity, FP32 [1, elements])."""

    def __init__(self, url: str, model: str, elements: int, protocol: str):
        self.url, self.model = url, model
        self.x = np.random.default_rng(0).standard_normal((1, elements)).astype(np.float32)
        if protocol == "grpc":
            import tritonclient.grpc as tc

            self.client = tc.InferenceServerClient(url)
            self.inp = tc.InferInput("INPUT0", list(self.x.shape), "FP32")
            self.inp.set_data_from_numpy(self.x)
            self.out = [tc.InferRequestedOutput("OUTPUT0")]
        else:
            import tritonclient.http as tc

            self.client = tc.InferenceServerClient(url)
            self.inp = tc.InferInput("INPUT0", list(self.x.shape), "FP32")
            self.inp.set_data_from_numpy(self.x, binary_data=True)
            self.out = [tc.InferRequestedOutput("OUTPUT0", binary_data=True)]
        self.times: list[float] = []

    def once(self, keep: bool) -> None:
        t = time.perf_counter()
        got = self.client.infer(self.model, [self.inp], outputs=self.out).as_numpy("OUTPUT0")
        dt = time.perf_counter() - t
        if not np.array_equal(got, self.x):
            raise SystemExit(f"{self.url}: wrong answer")
        if keep:
            self.times.append(dt)


def measure(urls: dict, model: str, elements: int, n: int, warmup: int,
            protocol: str = "http") -> dict:
    """Median round trip (us) per server. Requests alternate between the servers (one
    each, in turn), so that a machine whose load changes during the run weighs on
    every server alike; every answer is checked."""
    targets = {name: Target(url, model, elements, protocol) for name, url in urls.items()}
    try:
        for i in range(warmup + n):
            for target in targets.values():
                target.once(i >= warmup)
    finally:
        for target in targets.values():
            target.client.close()
    return {name: statistics.median(t.times) * 1e6 for name, t in targets.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", required=True, metavar="NAME=HOST:PORT")
    ap.add_argument("--model", default="identity")
    ap.add_argument("--protocol", choices=("http", "grpc"), default="http",
                    help="the client: tritonclient.http or tritonclient.grpc")
    ap.add_argument("--sizes", default="1024,262144", help="FP32 elements (4 KiB, 1 MiB)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    urls = dict(u.split("=", 1) for u in args.url)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for size in sizes:
        for name, p50 in measure(urls, args.model, size, args.requests, args.warmup,
                                 args.protocol).items():
            results[name, size] = p50
            print(f"{name:10s} {size * 4 / 1024:8.0f} KiB  p50 {p50:9.1f} us", flush=True)
    names = list(urls)
    if len(names) == 2:
        for size in sizes:
            a, b = results[names[0], size], results[names[1], size]
            print(f"{size * 4 / 1024:8.0f} KiB  {names[0]}/{names[1]} = {a / b:.2f}")


if __name__ == "__main__":
    main()
