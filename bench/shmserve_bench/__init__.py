"""shmserve bench: a latency and throughput benchmarking harness.

The library behind `shmserve bench`. In short:

    from shmserve_bench import BenchConfig, run_benchmark
    results = run_benchmark(BenchConfig(model="mlp", concurrency=[1, 8, 32]))
    for level in results[0].levels:
        print(level.concurrency, level.throughput, level.latency_us["p99"])

Modules: harness (a server started for tests, benchmarks and the soak), stats (percentiles, windows, stability), schedule (send times of the
request-rate mode), inputs (request data), load (the client processes), targets
(shmserve and KServe v2 endpoints), runner (the sweep and the stability loop),
cost (CPU per request by server process role), contention (busy processes),
proctree (the process table), report (table, CSV, JSON), plot (PNG charts, matplotlib).
"""
__all__ = ["BenchConfig", "LevelResult", "TargetResult", "run_benchmark"]


def __getattr__(name: str):
    # Loaded on first use: `shmserve` imports shmserve_bench.cli for every command,
    # and the runner (multiprocessing, numpy, the targets) only matters for `bench`.
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'shmserve_bench' has no attribute {name!r}")
