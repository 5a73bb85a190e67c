"""Round-trip latency of tritonclient.http (one keep-alive connection, concurrency 1,
binary tensor data) or tritonclient.grpc (one channel, raw contents) against KServe v2
servers given by URL: shmserve's fronts and the real Triton (../shared/peers,
`triton.sh start`). Same client, same model (identity, FP32 [1, n]), run one after
the other; prints medians and their ratio.

    python bench/http_vs_triton.py --url shmserve=127.0.0.1:8000 --url triton=127.0.0.1:18000
    python bench/http_vs_triton.py --protocol grpc \
        --url shmserve=127.0.0.1:8001 --url triton=127.0.0.1:18001
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def measure(url: str, model: str, elements: int, n: int, warmup: int,
            protocol: str = "http") -> float:
    """Median round trip in microseconds; every answer is checked."""
    x = np.random.default_rng(0).standard_normal((1, elements)).astype(np.float32)
    if protocol == "grpc":
        import tritonclient.grpc as tg

        client = tg.InferenceServerClient(url)
        inp = tg.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = [tg.InferRequestedOutput("OUTPUT0")]
    else:
        import tritonclient.http as th

        client = th.InferenceServerClient(url)
        inp = th.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = [th.InferRequestedOutput("OUTPUT0", binary_data=True)]
    times = []
    try:
        for i in range(warmup + n):
            t = time.perf_counter()
            got = client.infer(model, [inp], outputs=out).as_numpy("OUTPUT0")
            dt = time.perf_counter() - t
            if not np.array_equal(got, x):
                raise SystemExit(f"{url}: wrong answer")
            if i >= warmup:
                times.append(dt)
    finally:
        client.close()
    return statistics.median(times) * 1e6


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
    for name, url in urls.items():
        for size in sizes:
            results[name, size] = measure(url, args.model, size, args.requests, args.warmup,
                                          args.protocol)
            print(f"{name:10s} {size * 4 / 1024:8.0f} KiB  p50 {results[name, size]:9.1f} us",
                  flush=True)
    names = list(urls)
    if len(names) == 2:
        for size in sizes:
            a, b = results[names[0], size], results[names[1], size]
            print(f"{size * 4 / 1024:8.0f} KiB  {names[0]}/{names[1]} = {a / b:.2f}")


if __name__ == "__main__":
    main()
