"""`shmserve bench`: arguments (perf_analyzer's names where it has the option) and
the command. Kept free of heavy imports: shmserve.cli builds its parser from here."""
from __future__ import annotations

import argparse
import sys


def _range(text: str, kind=int) -> list:
    """perf_analyzer's start:end:step (end and step optional), or a list a,b,c."""
    if "," in text:
        return [kind(x) for x in text.split(",") if x]
    parts = text.split(":")
    start = kind(parts[0])
    end = kind(parts[1]) if len(parts) > 1 and parts[1] else start
    step = kind(parts[2]) if len(parts) > 2 and parts[2] else kind(1)
    if step <= 0 or end < start:
        raise argparse.ArgumentTypeError(f"bad range '{text}': need start <= end and step > 0")
    out, v = [], start
    while v <= end + (1e-9 if kind is float else 0):
        out.append(v)
        v = v + step
    return out


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("-m", "--model", dest="model", required=True, help="model to benchmark")
    b.add_argument("-x", "--model-version", dest="version", type=int, default=None)
    b.add_argument("-u", "--url", default=None,
                   help="target: shm://NAME (a shmserve server, default shm://<--name>), "
                        "grpc://HOST:PORT, http://HOST:PORT, grpc+shm://..., http+shm://... "
                        "(KServe v2 through tritonclient; +shm: system shared memory)")
    b.add_argument("--name", default=None, help="shmserve instance name (for shm://)")
    b.add_argument("--compare", action="append", default=[], metavar="URL",
                   help="also run the same sweep against this endpoint, after the main one "
                        "(repeatable), e.g. grpc://127.0.0.1:8001")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--concurrency-range", type=lambda t: _range(t, int), default=None,
                      metavar="START:END:STEP", help="concurrency sweep (default 1); a,b,c also works")
    load.add_argument("--request-rate-range", type=lambda t: _range(t, float), default=None,
                      metavar="START:END:STEP", help="request-rate sweep (requests/s), open loop")
    b.add_argument("--request-distribution", choices=["constant", "poisson"], default="constant")
    b.add_argument("--processes", type=int, default=1,
                   help="client processes sharing each level's load (watch client CPU%%)")
    b.add_argument("-b", "--batch-size", type=int, default=1)
    b.add_argument("--shape", action="append", default=[], metavar="NAME:d1,d2",
                   help="dims (without batch) for inputs with -1 dims")
    b.add_argument("--input-data", default="random",
                   help="random | zero | data.json (perf_analyzer format) | file.npy | "
                        "NAME=file.npy,... | a directory of NAME.npy")
    b.add_argument("-p", "--measurement-interval", type=int, default=2000, metavar="MS",
                   help="measurement window, milliseconds")
    b.add_argument("-s", "--stability-percentage", type=float, default=10.0,
                   help="allowed spread of throughput and latency over the last 3 windows")
    b.add_argument("-r", "--max-trials", type=int, default=10, help="most windows per level")
    b.add_argument("--percentile", type=float, default=None,
                   help="use this latency percentile for stability (default: mean)")
    b.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS",
                   help="load before the first window, not measured")
    b.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="upper bound on the whole run: each level gets an equal share of "
                        "what is left, its start-up and warm-up included")
    b.add_argument("--request-timeout", type=float, default=30.0, metavar="SECONDS")
    b.add_argument("--arena-bytes", type=int, default=None, help="shmserve client arena size")
    b.add_argument("--server-pid", type=int, default=None,
                   help="report the CPU of this process and its children as server CPU "
                        "(KServe targets; shmserve's is found by itself)")
    b.add_argument("-f", "--latency-report-file", dest="csv", default=None, metavar="FILE.csv")
    b.add_argument("--json", default=None, metavar="FILE")
    b.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here")
    b.add_argument("--no-breakdown", action="store_true", help="leave out the stage table")
    b.add_argument("-q", "--quiet", action="store_true", help="no live progress")


def config_from_args(args):
    from . import inputs as I
    from .runner import BenchConfig

    url = args.url or f"shm://{args.name or 'default'}"
    opts = {}
    if args.arena_bytes:
        opts["arena_bytes"] = args.arena_bytes
    return BenchConfig(
        model=args.model, url=url, compare=list(args.compare), version=args.version,
        concurrency=args.concurrency_range, request_rate=args.request_rate_range,
        distribution=args.request_distribution, processes=args.processes,
        batch_size=args.batch_size, shapes=I.parse_shapes(args.shape), input_data=args.input_data,
        measurement_interval_s=args.measurement_interval / 1000.0,
        stability_pct=args.stability_percentage, max_trials=args.max_trials,
        percentile=args.percentile, warmup_s=args.warmup, duration_s=args.duration,
        timeout_s=args.request_timeout, target_options=opts, progress=not args.quiet,
        server_pid=args.server_pid)


def run(args) -> int:
    from . import report
    from .inputs import InputError
    from .runner import errors_of, run_benchmark

    try:
        cfg = config_from_args(args)
    except InputError as e:
        print(f"shmserve bench: {e}", file=sys.stderr)
        return 2
    results = run_benchmark(cfg)
    print(report.table(results, breakdown=not args.no_breakdown))
    if args.csv:
        report.write_csv(results, args.csv)
    if args.json:
        report.write_json(results, args.json, config=cfg)
    if args.plot:
        from .plot import write_plots
        for p in write_plots(results, args.plot):
            print(f"wrote {p}", file=sys.stderr)
    errors = errors_of(results)
    if errors:
        print(f"shmserve bench: {sum(errors.values())} request(s) failed: " + "; ".join(
            f"{n} x {m}" for m, n in errors.most_common(3)), file=sys.stderr)
    failed = [tr for tr in results if tr.error and not tr.levels]
    return 1 if failed or errors else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="shmserve bench", description="latency benchmark")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
