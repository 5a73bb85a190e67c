"""Round-trip latency of tritonclient.http (one keep-alive connection, concurrency 1,
binary tensor data), tritonclient.grpc (one channel, raw contents) or tritonclient.grpc
with system shared memory (input and output in POSIX shm regions registered with the
server; the input copied in and the output read back inside the timed call) against
KServe v2 servers given by URL: shmserve's fronts and the real Triton (../shared/peers,
`triton.sh start`). Same client, same model (identity, FP32 [1, n]), requests alternating
between the servers; prints medians, their ratio, and with --repeats the median over
repeats of each.

    python bench/http_vs_triton.py --url shmserve=127.0.0.1:8000 --url triton=127.0.0.1:18000
    python bench/http_vs_triton.py --protocol grpc \
        --url shmserve=127.0.0.1:8001 --url triton=127.0.0.1:18001
    python bench/http_vs_triton.py --protocol grpc-shm --repeats 3 \
        --url shmserve=127.0.0.1:8001 --url triton=127.0.0.1:18001
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


class Target:
    """One server's client and request (identity, FP32 [1, elements])."""

    def __init__(self, url: str, model: str, elements: int, protocol: str):
        self.url, self.model = url, model
        self.x = np.random.default_rng(0).standard_normal((1, elements)).astype(np.float32)
        self.shm = None
        if protocol.startswith("grpc"):
            import tritonclient.grpc as tc

            self.client = tc.InferenceServerClient(url)
            self.inp = tc.InferInput("INPUT0", list(self.x.shape), "FP32")
            self.out = [tc.InferRequestedOutput("OUTPUT0")]
            if protocol == "grpc-shm":
                self._use_shm()
            else:
                self.inp.set_data_from_numpy(self.x)
        else:
            import tritonclient.http as tc

            self.client = tc.InferenceServerClient(url)
            self.inp = tc.InferInput("INPUT0", list(self.x.shape), "FP32")
            self.inp.set_data_from_numpy(self.x, binary_data=True)
            self.out = [tc.InferRequestedOutput("OUTPUT0", binary_data=True)]
        self.times: list[float] = []

    def _use_shm(self) -> None:
        import tritonclient.utils.shared_memory as shm

        self.shm, nbytes = shm, self.x.nbytes
        tag = f"hvt{os.getpid()}_{abs(hash(self.url)) % 10000}_{self.x.size}"
        self.names = (f"{tag}_in", f"{tag}_out")
        self.regions = [shm.create_shared_memory_region(name, "/" + name, nbytes)
                        for name in self.names]
        for name in self.names:
            self.client.unregister_system_shared_memory(name)
            self.client.register_system_shared_memory(name, "/" + name, nbytes)
        self.inp.set_shared_memory(self.names[0], nbytes)
        self.out[0].set_shared_memory(self.names[1], nbytes)

    def once(self, keep: bool) -> None:
        t = time.perf_counter()
        if self.shm is None:
            got = self.client.infer(self.model, [self.inp], outputs=self.out).as_numpy("OUTPUT0")
        else:
            self.shm.set_shared_memory_region(self.regions[0], [self.x])
            self.client.infer(self.model, [self.inp], outputs=self.out)
            got = self.shm.get_contents_as_numpy(self.regions[1], np.float32, self.x.shape)
        dt = time.perf_counter() - t
        if not np.array_equal(got, self.x):
            raise SystemExit(f"{self.url}: wrong answer")
        if self.shm is not None:
            self.shm.set_shared_memory_region(self.regions[1], [np.zeros_like(self.x)])
        if keep:
            self.times.append(dt)

    def close(self) -> None:
        if self.shm is not None:
            for name, region in zip(self.names, self.regions):
                self.client.unregister_system_shared_memory(name)
                self.shm.destroy_shared_memory_region(region)
        self.client.close()


def measure(urls: dict, model: str, elements: int, n: int, warmup: int,
            protocol: str = "http") -> dict:
    """Median round trip (us) per server. Requests alternate between the servers (one
    each, in turn), so that a machine whose load changes during the run weighs on
    every server alike; every answer is checked."""
    targets = {}
    try:
        for name, url in urls.items():
            targets[name] = Target(url, model, elements, protocol)
        for i in range(warmup + n):
            for target in targets.values():
                target.once(i >= warmup)
    finally:
        for target in targets.values():
            target.close()
    return {name: statistics.median(t.times) * 1e6 for name, t in targets.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", required=True, metavar="NAME=HOST:PORT")
    ap.add_argument("--model", default="identity")
    ap.add_argument("--protocol", choices=("http", "grpc", "grpc-shm"), default="http",
                    help="the client: tritonclient.http, tritonclient.grpc, or "
                         "tritonclient.grpc with system shared memory")
    ap.add_argument("--sizes", default="1024,262144", help="FP32 elements (4 KiB, 1 MiB)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every size; the summary is the median over them")
    args = ap.parse_args()
    urls = dict(u.split("=", 1) for u in args.url)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict = {}
    for repeat in range(args.repeats):
        for size in sizes:
            for name, p50 in measure(urls, args.model, size, args.requests, args.warmup,
                                     args.protocol).items():
                results.setdefault((name, size), []).append(p50)
                print(f"[{repeat + 1}] {args.protocol:8s} {name:10s} {size * 4 / 1024:6.0f} KiB  "
                      f"p50 {p50:9.1f} us", flush=True)
    names = list(urls)
    for size in sizes:
        medians = {name: statistics.median(results[name, size]) for name in names}
        line = "  ".join(f"{name} {p50:.0f} us" for name, p50 in medians.items())
        if len(names) == 2:
            ratios = [a / b for a, b in zip(results[names[0], size], results[names[1], size])]
            line += f"  {names[0]}/{names[1]} {statistics.median(ratios):.2f} (per repeat: " \
                    + ", ".join(f"{r:.2f}" for r in ratios) + ")"
        print(f"{args.protocol:8s} {size * 4 / 1024:6.0f} KiB  median of {args.repeats}: {line}")


if __name__ == "__main__":
    main()
