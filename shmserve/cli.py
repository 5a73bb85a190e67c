"""The `shmserve` command: serve, validate, models, stats, status, health, infer, bench."""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
import time

import numpy as np

from .errors import ShmServeError
from .segments import DEFAULT_NAME


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _bool(text: str) -> bool:
    """Triton's boolean option values: true/false, 1/0 (also yes/no, on/off)."""
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false, 1/0)")


def metrics_options(args) -> dict:
    """--metrics-port / --allow-metrics / --metrics-config as ServeOptions fields:
    metrics are served when a port is given or --allow-metrics=true (then on 8002,
    Triton's port); never by default, since several servers may share the host."""
    from .errors import ConfigError
    from .server.metrics import parse_metrics_config

    port = args.metrics_port
    if args.allow_metrics is False:
        port = None
    elif args.allow_metrics and port is None:
        port = 8002
    try:
        config = parse_metrics_config(args.metrics_config)
    except ConfigError as e:
        raise SystemExit(f"shmserve serve: {e}") from None
    config.update(cpu=args.allow_cpu_metrics, gpu=args.allow_gpu_metrics)
    if args.metrics_interval_ms <= 0:
        raise SystemExit("shmserve serve: --metrics-interval-ms must be positive")
    return {"metrics_port": port, "metrics_address": args.metrics_address,
            "metrics_config": config, "metrics_interval_ms": args.metrics_interval_ms}


def http_options(args) -> dict:
    """--http-port / --allow-http / --http-address / --http-thread-count as ServeOptions
    fields: the HTTP front (KServe v2) is served when a port is given or
    --allow-http=true (then on 8000, Triton's port); off by default, like metrics."""
    port = args.http_port
    if args.allow_http is False:
        port = None
    elif args.allow_http and port is None:
        port = 8000
    if port is not None and not 0 < port <= 65535:
        raise SystemExit(f"shmserve serve: --http-port {port} is not a port number (1-65535)")
    if args.http_thread_count < 1:
        raise SystemExit(f"shmserve serve: --http-thread-count must be at least 1, "
                         f"not {args.http_thread_count}")
    return {"http_port": port, "http_address": args.http_address,
            "http_thread_count": args.http_thread_count}


# Triton's gRPC keep-alive flags -> grpcio's channel arguments (values in ms or counts).
GRPC_CHANNEL_FLAGS = {
    "grpc_keepalive_time": "grpc.keepalive_time_ms",
    "grpc_keepalive_timeout": "grpc.keepalive_timeout_ms",
    "grpc_keepalive_permit_without_calls": "grpc.keepalive_permit_without_calls",
    "grpc_http2_max_pings_without_data": "grpc.http2.max_pings_without_data",
    "grpc_http2_min_recv_ping_interval_without_data":
        "grpc.http2.min_ping_interval_without_data_ms",
    "grpc_http2_max_ping_strikes": "grpc.http2.max_ping_strikes",
}
GRPC_COMPRESSION_LEVELS = ("none", "low", "medium", "high")  # Triton's names, grpc's order


def grpc_options(args) -> dict:
    """--grpc-port / --allow-grpc / --grpc-address / --grpc-infer-thread-count and the
    keep-alive and compression flags as ServeOptions fields: the gRPC front is served
    when a port is given or --allow-grpc=true (then on 8001, Triton's port)."""
    port = args.grpc_port
    if args.allow_grpc is False:
        port = None
    elif args.allow_grpc and port is None:
        port = 8001
    if port is not None and not 0 < port <= 65535:
        raise SystemExit(f"shmserve serve: --grpc-port {port} is not a port number (1-65535)")
    if args.grpc_infer_thread_count < 1:
        raise SystemExit(f"shmserve serve: --grpc-infer-thread-count must be at least 1, "
                         f"not {args.grpc_infer_thread_count}")
    channel = {}
    for flag, arg in GRPC_CHANNEL_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if value < 0:
            raise SystemExit(f"shmserve serve: --{flag.replace('_', '-')} must not be negative, "
                             f"not {value}")
        channel[arg] = int(value)
    level = args.grpc_infer_response_compression_level
    return {"grpc_port": port, "grpc_address": args.grpc_address,
            "grpc_infer_thread_count": args.grpc_infer_thread_count,
            "grpc_options": {"channel": channel,
                             "compression_level": GRPC_COMPRESSION_LEVELS.index(level)}}


def _log_format(text: str) -> str:
    from .logs import parse_format

    try:
        return parse_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _log_level(text: str) -> str:
    from .logs import parse_level

    try:
        return parse_level(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _verbosity(text: str) -> int:
    try:
        level = int(text)
    except ValueError:
        level = -1
    if level < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a verbose level (0 off, 1 or more on)")
    return level


def _whole_number(unit: str):
    """A validator for a count of `unit` (0 or more), named in its error message."""
    def parse(text: str) -> int:
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}")
        return int(text)
    return parse


_byte_count = _whole_number("bytes")
_request_count = _whole_number("requests (0: no limit)")
_milliseconds = _whole_number("milliseconds (0: off)")


def _cuda_pool(text: str) -> tuple[int, int]:
    """Triton's <GPU>:<bytes>."""
    gpu, sep, size = text.partition(":")
    if not sep or not gpu.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: write <GPU number>:<bytes>, e.g. 0:268435456")
    return int(gpu), _byte_count(size)


def trace_options(args) -> dict:
    """--trace-config as the ServeOptions field (Triton's settings; tracing.py)."""
    from .errors import ConfigError
    from .server.tracing import parse_trace_config

    try:
        return {"trace": parse_trace_config(args.trace_config)}
    except ConfigError as e:
        raise SystemExit(f"shmserve serve: {e}") from None


def cache_option(args) -> int:
    """--cache-config as Triton's: the bytes of the local response cache (0: none)."""
    from .errors import ConfigError
    from .server.response_cache import parse_cache_config

    try:
        return parse_cache_config(args.cache_config)
    except ConfigError as e:
        raise SystemExit(f"shmserve serve: {e}") from None


def cmd_serve(args) -> int:
    from .server.coordinator import ServeOptions, run

    return run(ServeOptions(**metrics_options(args), **trace_options(args), **http_options(args),
                            **grpc_options(args), model_repository=args.model_repository, name=args.name,
                            max_clients=args.max_clients, slots_per_client=args.slots_per_client,
                            max_arena_bytes=args.max_arena_bytes, spin_us=args.spin_us,
                            max_spin_us=args.max_spin_us, cpu_watch_ms=args.cpu_watch_ms,
                            colocate_when_crowded=args.colocate_when_crowded,
                            load_timeout_s=args.load_timeout,
                            idle_check_ms=args.idle_check_ms,
                            max_queued_per_client=args.max_queued_per_client,
                            exit_timeout_s=args.exit_timeout_secs,
                            log_level=args.log_level, log_verbose=args.log_verbose,
                            log_info=args.log_info, log_warning=args.log_warning,
                            log_error=args.log_error, log_format=args.log_format,
                            log_file=args.log_file, group=args.group,
                            exit_on_error=args.exit_on_error,
                            model_control_mode=args.model_control_mode,
                            load_model=args.load_model,
                            repository_poll_secs=args.repository_poll_secs,
                            model_table_size=args.model_table_size,
                            max_model_instances=args.max_model_instances,
                            strict_readiness=args.strict_readiness,
                            cuda_pools=dict(args.cuda_memory_pool_byte_size),
                            pinned_pool_bytes=args.pinned_memory_pool_byte_size,
                            cache_bytes=cache_option(args),
                            auto_complete_config=not (args.disable_auto_complete_config
                                                      or args.strict_model_config)))


VALID, INVALID, NO_REPOSITORY = 0, 1, 2  # `shmserve validate` exit codes


def cmd_validate(args) -> int:
    from .errors import ConfigError
    from .server.validate import format_report, validate_repository

    try:
        report = validate_repository(args.dir, auto_complete=not (
            args.disable_auto_complete_config or args.strict_model_config))
    except ConfigError as e:  # DIR is not a directory
        print(f"shmserve validate: {e.msg}", file=sys.stderr)
        return NO_REPOSITORY
    if args.json:
        print(json.dumps([f.to_dict() for f in report.findings], indent=2))
    else:
        print(format_report(report))
    return INVALID if report.errors else VALID


def format_models(models: list[dict], statistics: list[dict]) -> str:
    """The `shmserve models` table: one line per model version, the state word in
    full (READY, LOADING, UNAVAILABLE; the column is as wide as the widest), requests
    answered OK and with an error, executions and batches by number of requests; the
    reason of a state that has one on its own line below."""
    stats = {(s["name"], int(s["version"])): s for s in statistics}
    head = ["model", "version", "state", "backend", "max_batch", "success", "failure",
            "executions"]
    right = {"version", "max_batch", "success", "failure", "executions"}
    rows, notes = [], []
    for m in models:
        s = stats.get((m["name"], m["version"]), {})
        state, _, reason = m["state"].partition(":")
        own = s.get("shmserve", {})
        hist = " ".join(f"{k}:{v}" for k, v in sorted(own.get("batch_requests", {}).items(),
                                                      key=lambda kv: int(kv[0])))
        counts = s.get("inference_stats", {})
        rows.append([m["name"], str(m["version"]), state.strip(), m["platform"],
                     str(m["max_batch_size"]), str(counts.get("success", {}).get("count", 0)),
                     str(counts.get("fail", {}).get("count", 0)), str(s.get("execution_count", 0)),
                     hist])
        notes.append(reason.strip())
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        cols = [c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(cells, widths, head)]
        return ("  ".join(cols) + "  " + cells[-1]).rstrip()

    out = [line(head + ["batches by size"])]
    for row, note in zip(rows, notes):
        out.append(line(row))
        if note:
            out.append(f"    reason: {note}")
    return "\n".join(out)


def cmd_models(args) -> int:
    from . import protocol as P

    models, stats = _ask(args.name, P.ListModels(), P.GetStats())
    print(format_models(models.models, stats.model_stats))
    return 0


def format_stats(model_stats: list[dict]) -> str:
    """The `shmserve stats` table: counts, then the mean time per request of each
    stage (Triton's inference_stats, ns summed over requests, divided by their count)."""
    head = ["model", "version", "success", "failure", "executions", "inferences",
            "request_us", "queue_us", "input_us", "infer_us", "output_us"]
    rows = []
    for s in model_stats:
        inf = s["inference_stats"]

        def mean_us(*kinds) -> str:
            n = sum(inf[k]["count"] for k in kinds)
            return f"{sum(inf[k]['ns'] for k in kinds) / n / 1000:.1f}" if n else "-"

        rows.append([s["name"], str(s["version"]), str(inf["success"]["count"]),
                     str(inf["fail"]["count"]), str(s["execution_count"]),
                     str(s["inference_count"]), mean_us("success", "fail"), mean_us("queue"),
                     mean_us("compute_input"), mean_us("compute_infer"),
                     mean_us("compute_output")])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
                     for cells in [head] + rows)


def cmd_stats(args) -> int:
    from . import protocol as P
    from .client.request import version_key
    from .server.statistics import triton_only

    (reply,) = _ask(args.name, P.GetStats(args.model, version_key(args.version)))
    stats = reply.model_stats
    if args.json:  # the statistics extension's response, as Triton's HTTP front gives it
        print(json.dumps({"model_stats": [triton_only(s) for s in stats]}, indent=2))
    else:
        print(format_stats(stats))
    return 0


def cmd_load(args) -> int:
    from . import protocol as P

    _ask(args.name, P.LoadModel(args.model, args.config), timeout=args.timeout)
    print(f"model '{args.model}' loaded")
    return 0


def cmd_unload(args) -> int:
    from . import protocol as P

    _ask(args.name, P.UnloadModel(args.model, args.unload_dependents), timeout=args.timeout)
    print(f"model '{args.model}' unloaded")
    return 0


def format_index(rows: list[dict]) -> str:
    """The `shmserve index` table: Triton's repository index, one row per version."""
    head = ["model", "version", "state", "reason"]
    cells = [[r["name"], r["version"] or "-", r["state"] or "-", r["reason"]] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [head] + cells)


def cmd_index(args) -> int:
    from . import protocol as P

    (reply,) = _ask(args.name, P.RepositoryIndex(args.ready))
    if args.json:  # Triton's POST /v2/repository/index answer
        print(json.dumps([{k: v for k, v in r.items() if v != ""} for r in reply.models],
                         indent=2))
    else:
        print(format_index(reply.models))
    return 0


def cmd_trace_summary(args) -> int:
    from .server.trace_summary import main as summary

    return summary(args.file)


HEALTHY, UNHEALTHY, NO_SERVER = 0, 1, 2  # `shmserve health` exit codes


class _NoServer(Exception):
    """No server answered: not running, dead, refused, or silent past the timeout."""


def _control_call(sock: socket.socket, request, deadline: float, name: str):
    """One control request on a bare connection (no hello: no lease, no arena): its
    typed reply or ErrorReply. The send, and each receive of the reply, are bounded by
    what is left of `deadline` (monotonic) when they begin."""
    from . import protocol as P

    try:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.sendall(P.pack_frame(request))
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        return P.decode_reply(request, P.recv_frame(sock))
    except socket.timeout:
        raise _NoServer(f"server '{name}' did not answer within the timeout") from None
    except OSError as e:  # ConnectionError too: the server closed the connection
        raise _NoServer(f"server '{name}' is gone ({e.strerror or e})") from None
    except ValueError as e:
        raise _NoServer(f"server '{name}' sent a malformed reply ({e})") from None


def _control_connect(name: str, timeout: float) -> socket.socket:
    """A bare connection to server `name`'s control socket (no hello: no lease);
    _NoServer, saying why, when nothing accepts it within `timeout` seconds."""
    from .segments import socket_path

    path = str(socket_path(name, create=False))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(timeout, 1e-3))
        sock.connect(path)
    except socket.timeout:
        sock.close()
        raise _NoServer(f"server '{name}' did not accept a connection within "
                        f"{timeout:g} s") from None
    except OSError as e:
        sock.close()
        raise _NoServer(f"no server '{name}' ({path}: {e.strerror or e})") from None
    return sock


def _ask(name: str, *requests, timeout: float = 10.0) -> list:
    """Read-only control requests on one bare connection (no lease, no arena): their
    replies, in order; an error reply raises as the client's would."""
    from . import errors
    from . import protocol as P

    deadline = time.monotonic() + timeout
    try:
        sock = _control_connect(name, timeout)
        try:
            replies = [_control_call(sock, r, deadline, name) for r in requests]
        finally:
            sock.close()
    except _NoServer as e:
        raise errors.ServerDeadError(str(e)) from None
    for reply in replies:
        if isinstance(reply, P.ErrorReply):
            raise errors.from_status(reply.code, reply.error, reply.type)
    return replies


def check_health(name: str, ready: bool = False, model: str | None = None,
                 version: int | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """(exit code, why) of Triton's health checks against server `name`: live = its
    control socket answers; ready = live and every model is READY (the server's
    --strict-readiness, default true; false: ready = live); with `model`: that model,
    the given version or the highest, is READY. Asks without a hello, so no lease is
    opened and no arena made; the whole check takes at most `timeout` seconds."""
    from . import protocol as P
    from .client.request import version_key

    deadline = time.monotonic() + timeout
    try:
        sock = _control_connect(name, timeout)
    except _NoServer as e:
        return NO_SERVER, str(e)
    try:
        if model is None:
            reply = _control_call(sock, P.ListModels(), deadline, name)
        else:
            reply = _control_call(sock, P.GetMetadata(model, version_key(version)),
                                  deadline, name)
    except _NoServer as e:
        return NO_SERVER, str(e)
    finally:
        sock.close()
    if isinstance(reply, P.ErrorReply):
        return UNHEALTHY, reply.error
    if model is None and not ready:
        return HEALTHY, f"server '{name}' is live"
    rows = reply.models if model is None else [dataclasses.asdict(reply)]
    down = [m for m in rows if m["state"] != "READY"]
    # The server's own answer decides (its --strict-readiness); one that gives none
    # is strict, as Triton's default.
    server_ready = not down if model is not None or reply.ready is None else reply.ready
    if server_ready:
        what = (f"model '{model}' version {rows[0]['version']}" if model is not None
                else f"server '{name}' ({len(rows)} model{'s' * (len(rows) != 1)})")
        if down:  # --strict-readiness=false: ready while it serves
            return HEALTHY, (f"{what} is ready (--strict-readiness=false: {len(down)} not "
                             f"READY, e.g. model '{down[0]['name']}' version "
                             f"{down[0]['version']} is {down[0]['state']})")
        return HEALTHY, f"{what} is ready"
    if not down:
        return UNHEALTHY, f"not ready: server '{name}' says it is not ready"
    first = down[0]
    more = f" (and {len(down) - 1} more not ready)" if len(down) > 1 else ""
    return UNHEALTHY, (f"not ready: model '{first['name']}' version {first['version']} is "
                       f"{first['state']}{more}")


def cmd_status(args) -> int:
    from .status import run

    if not args.interval > 0:
        print(f"shmserve status: --interval must be a positive number of seconds, not "
              f"{args.interval:g}", file=sys.stderr)
        return 1
    return run(args.name, interval=args.interval, once=args.once, timeout=args.timeout)


def cmd_health(args) -> int:
    if args.version is not None and args.model is None:
        print("shmserve health: --version needs --model", file=sys.stderr)
        return UNHEALTHY
    code, why = check_health(args.name, ready=args.ready, model=args.model,
                             version=args.version, timeout=args.timeout)
    if code != HEALTHY:
        print(f"shmserve health: {why}", file=sys.stderr)
    elif not args.quiet:
        print(why)
    return code


def _make_input(spec: dict, value: str, batch: int, max_batch: int, rng) -> np.ndarray:
    from .protocol import DTYPE_CODES, numpy_dtype

    if value != "random" and value != "zeros":
        return np.load(value, allow_pickle=False)
    shape = list(spec["shape"])
    if max_batch > 0:
        shape[0] = batch
    if any(d < 0 for d in shape):
        raise SystemExit(f"input '{spec['name']}' has variable dims {spec['shape']}: give a .npy file "
                         "or --shape NAME=d1,d2")
    dtype = spec["datatype"]
    if dtype == "BYTES":
        return np.array([str(i).encode() for i in range(int(np.prod(shape)))], dtype=object).reshape(shape)
    dt = numpy_dtype(DTYPE_CODES[dtype])
    if value == "zeros":
        return np.zeros(shape, dt)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    return rng.integers(0, 100, shape).astype(dt)


def cmd_infer(args) -> int:
    from .client import Client

    rng = np.random.default_rng(0)
    with Client(args.name) as c:
        meta = c.model_metadata(args.model, args.version)
        given = dict(kv.split("=", 1) for kv in args.input)
        shapes = {k: [int(d) for d in v.split(",")] for k, v in
                  (kv.split("=", 1) for kv in args.shape)}
        inputs = {}
        for spec in meta["inputs"]:
            spec = dict(spec)
            if spec["name"] in shapes:
                spec["shape"] = ([-1] if meta["max_batch_size"] > 0 else []) + shapes[spec["name"]]
            inputs[spec["name"]] = _make_input(spec, given.get(spec["name"], "random"), args.batch,
                                               meta["max_batch_size"], rng)
        latencies = []
        result = None
        for _ in range(args.repeat):
            t0 = time.perf_counter_ns()
            result = c.infer(args.model, inputs, version=args.version, copy=True)
            latencies.append((time.perf_counter_ns() - t0) / 1000)
        np.set_printoptions(threshold=32, edgeitems=4)
        print(f"model '{result.model_name}' version {result.model_version}")
        for name, arr in result.items():
            print(f"{name} {arr.dtype} {list(arr.shape)}:\n{arr}")
        lat = np.array(latencies)
        print(f"latency over {len(lat)} request(s): p50 {np.percentile(lat, 50):.1f} us, "
              f"p99 {np.percentile(lat, 99):.1f} us, min {lat.min():.1f} us")
    return 0


def cmd_bench(args) -> int:
    from shmserve_bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shmserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve a model repository")
    s.add_argument("--model-repository", required=True, help="Triton-style model repository")
    s.add_argument("--name", default=DEFAULT_NAME, help="instance name (several servers per host)")
    s.add_argument("--max-clients", type=int, default=64, help="client leases at once")
    s.add_argument("--slots-per-client", type=int, default=32, help="requests in flight per client")
    s.add_argument("--max-arena-bytes", type=_size, default=1 << 30,
                   help="largest arena a client may ask for (e.g. 256M)")
    s.add_argument("--spin-us", type=int, default=50,
                   help="microseconds the batcher and workers spin (yielding the CPU) before "
                        "they sleep on a futex; 0 = sleep at once")
    s.add_argument("--max-spin-us", type=int, default=200,
                   help="longest adaptive spin, used while requests arrive that often")
    s.add_argument("--cpu-watch-ms", type=_milliseconds, default=100, metavar="MS",
                   help="how often the server measures the CPU other work takes while a client "
                        "is connected; while it leaves no CPU idle, the server's and its "
                        "clients' waiters sleep at once instead of spinning (0 = do not watch: "
                        "spin whatever the load)")
    s.add_argument("--colocate-when-crowded", type=_bool, default=True, metavar="BOOL",
                   help="while the CPU watch finds every CPU crowded, run the batcher and the "
                        "workers on the CPU their callers run on (a wake-up there preempts the "
                        "other work at once; one elsewhere waits for an interrupt): lower "
                        "latency, less throughput on a crowded machine (default true)")
    s.add_argument("--exit-timeout-secs", type=float, default=30,
                   help="on SIGINT/SIGTERM/SIGHUP, wait this long for requests in flight (new "
                        "ones are refused meanwhile); a second signal stops at once")
    s.add_argument("--max-queued-per-client", type=_request_count, default=0, metavar="N",
                   help="at most N requests of one client queued per model; more are refused "
                        "BUSY (default 0: no limit, the queue's fair share between clients "
                        "protects them; model parameter shmserve.max_queued_per_client "
                        "overrides it; docs/reliability.md)")
    s.add_argument("--idle-check-ms", type=int, default=100,
                   help="how often an idle batcher checks that the coordinator lives; requests "
                        "never wait for it (a worker going idle rings the batcher)")
    s.add_argument("--http-port", type=int, default=None,
                   help="serve KServe v2 HTTP/REST (Triton's endpoints, docs/operating.md) "
                        "on this port")
    s.add_argument("--allow-http", type=_bool, default=None, nargs="?", const=True,
                   metavar="BOOL", help="true: serve HTTP (on --http-port, else 8000); "
                   "false: never, even with --http-port")
    s.add_argument("--http-address", default="127.0.0.1",
                   help="address for the HTTP front (loopback unless told otherwise)")
    s.add_argument("--http-thread-count", type=int, default=1, metavar="N",
                   help="HTTP front processes sharing the port (SO_REUSEPORT), each a client "
                        "of the engine; more of them use more cores")
    s.add_argument("--grpc-port", type=int, default=None,
                   help="serve KServe v2 gRPC (Triton's GRPCInferenceService, "
                        "docs/operating.md) on this port (Triton's is 8001)")
    s.add_argument("--allow-grpc", type=_bool, default=None, nargs="?", const=True,
                   metavar="BOOL", help="true: serve gRPC (on --grpc-port, else 8001); "
                   "false: never, even with --grpc-port")
    s.add_argument("--grpc-address", default="127.0.0.1",
                   help="address for the gRPC front (loopback unless told otherwise)")
    s.add_argument("--grpc-infer-thread-count", type=int, default=1, metavar="N",
                   help="gRPC front processes sharing the port (SO_REUSEPORT), each a client "
                        "of the engine; more of them use more cores")
    for flag, what in [("keepalive-time", "ms between keep-alive pings (grpc default: 2 h)"),
                       ("keepalive-timeout", "ms to wait for a keep-alive ping's answer"),
                       ("keepalive-permit-without-calls", "true: ping with no call in flight"),
                       ("http2-max-pings-without-data", "pings sent with no data between"),
                       ("http2-min-recv-ping-interval-without-data",
                        "ms a client must wait between pings with no data"),
                       ("http2-max-ping-strikes", "bad pings before the connection closes")]:
        boolean = flag == "keepalive-permit-without-calls"
        s.add_argument(f"--grpc-{flag}", type=_bool if boolean else int, default=None,
                       metavar="BOOL" if boolean else "N", help=f"Triton's gRPC option: {what}")
    s.add_argument("--grpc-infer-response-compression-level", default="none",
                   choices=GRPC_COMPRESSION_LEVELS,
                   help="compress the gRPC front's responses (the client picks gzip or deflate "
                        "among those it accepts; none: never)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics (Triton's families) on this port")
    s.add_argument("--metrics-address", default="127.0.0.1",
                   help="address for the metrics endpoint (loopback unless told otherwise)")
    s.add_argument("--allow-metrics", type=_bool, default=None, nargs="?", const=True,
                   metavar="BOOL", help="true: serve metrics (on --metrics-port, else 8002); "
                   "false: never, even with --metrics-port")
    s.add_argument("--allow-cpu-metrics", type=_bool, default=True, nargs="?", const=True,
                   metavar="BOOL", help="nv_cpu_* families (default true)")
    s.add_argument("--allow-gpu-metrics", type=_bool, default=True, nargs="?", const=True,
                   metavar="BOOL", help="nv_gpu_* families where NVML finds a GPU (default true)")
    s.add_argument("--metrics-interval-ms", type=int, default=2000,
                   help="how often CPU/GPU gauges and the summaries' window are refreshed")
    s.add_argument("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
                   help="as Triton: summary_latencies=true, summary_quantiles=0.5:0.05,..., "
                        "counter_latencies=false, histogram_latencies=true")
    s.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]KEY=VALUE",
                   help="request traces, as Triton: level=TIMESTAMPS (default OFF), rate=N "
                        "(one request in N, default 1000), count=N (-1: no limit), "
                        "mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N, "
                        "opentelemetry,url=URL (docs/operating.md, Traces)")
    s.add_argument("--load-timeout", type=float, default=120.0,
                   help="seconds a model instance may take to load before it is UNAVAILABLE")
    s.add_argument("--log-verbose", type=_verbosity, default=0, metavar="N",
                   help="verbose logging: 0 off (default), 1 or more on (Triton's option)")
    for severity in ("info", "warning", "error"):
        s.add_argument(f"--log-{severity}", type=_bool, default=True, nargs="?", const=True,
                       metavar="BOOL", help=f"{severity} lines on or off (default true)")
    s.add_argument("--log-format", type=_log_format, default="default",
                   metavar="default|ISO8601",
                   help="line format: default 'I1203 15:06:14.123456 PID ROLE/FILE:LINE] msg' "
                        "or ISO8601 '2026-12-03T15:06:14Z I PID ROLE/FILE:LINE] msg' (UTC)")
    s.add_argument("--log-file", default=None, metavar="PATH",
                   help="append every process's log lines to this file (created 0600) "
                        "instead of stderr")
    s.add_argument("--log-level", type=_log_level, default="info",
                   metavar="debug|info|warning|error",
                   help="older shorthand: debug = --log-verbose 1, warning = --log-info=false, "
                        "error = also --log-warning=false")
    s.add_argument("--exit-on-error", type=_bool, default=True, nargs="?", const=True,
                   metavar="BOOL",
                   help="a model that cannot be loaded (broken config.pbtxt, missing model "
                        "file) stops the start, exit 2 (default true, Triton's); false: serve "
                        "the others and list it UNAVAILABLE with the reason")
    s.add_argument("--model-control-mode", choices=("none", "explicit", "poll"), default="none",
                   help="Triton's: none (default) loads the repository at start, load/unload "
                        "refused; explicit: only --load-model models at start, then `shmserve "
                        "load/unload`; poll: load everything, then pick up changes of the "
                        "repository every --repository-poll-secs")
    s.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="with --model-control-mode explicit: load this model at start "
                        "(repeatable; '*' = every model)")
    s.add_argument("--repository-poll-secs", type=float, default=15.0, metavar="S",
                   help="poll mode: seconds between scans of the repository (default 15)")
    s.add_argument("--model-table-size", type=int, default=None, metavar="N",
                   help="model versions the server can hold at once, reserved at start "
                        "(explicit and poll: default twice the start's, at least 64; a "
                        "reload holds old and new for a moment)")
    s.add_argument("--max-model-instances", type=int, default=None, metavar="N",
                   help="model instances (workers) at once, reserved at start (explicit and "
                        "poll: default twice the start's, at least 128)")
    s.add_argument("--strict-readiness", type=_bool, default=True, nargs="?", const=True,
                   metavar="BOOL",
                   help="the server is ready (`shmserve health --ready`) only while every model "
                        "is READY (default true, Triton's); false: ready as soon as it serves, "
                        "whatever its models' states")
    s.add_argument("--disable-auto-complete-config", action="store_true",
                   help="do not complete an ONNX model's configuration from its graph: every "
                        "model needs a config.pbtxt naming its inputs, outputs and "
                        "max_batch_size (Triton's option)")
    s.add_argument("--strict-model-config", type=_bool, default=False, nargs="?", const=True,
                   metavar="BOOL",
                   help="Triton's older spelling: true is --disable-auto-complete-config")
    s.add_argument("--cuda-memory-pool-byte-size", type=_cuda_pool, action="append",
                   default=[], metavar="GPU:BYTES",
                   help="as Triton: caps the device memory shmserve allocates for staging on "
                        "that GPU (the tensorrt backend's input and output buffers; "
                        "docs/gpu.md); repeat for each GPU")
    s.add_argument("--pinned-memory-pool-byte-size", type=_byte_count, default=None,
                   metavar="BYTES",
                   help="Triton's pinned host pool: accepted, and ignored with a warning "
                        "(shmserve does not pin the callers' arenas yet; docs/gpu.md)")
    s.add_argument("--cache-config", action="append", default=[], metavar="local,size=BYTES",
                   help="as Triton: the response cache for models whose config sets "
                        "response_cache { enable: true }; only the local cache (size in "
                        "bytes, shared out among those models' instances)")
    s.add_argument("--group", default=None, metavar="GROUP",
                   help="also serve clients of this group (other uids): the control socket "
                        "becomes group read-write, the runtime directory group-traversable; "
                        "the server's user must be a member")
    s.set_defaults(fn=cmd_serve)

    v = sub.add_parser(
        "validate", help="check a model repository without serving it: every problem, with "
        "file, line and fix; exit 0 valid, 1 problems, 2 no such directory",
        description="Checks a model repository as `shmserve serve` would load it, and more, "
                    "without serving it: no shared-memory segment, no server process, no "
                    "model code (except a python model's auto_complete_config hook when "
                    "auto-complete is on, which `serve` runs too; it is reported). Lists every "
                    "problem found, each with its file, line (where the config parser gives "
                    "one or the field is written) and a fix: config.pbtxt syntax and unknown "
                    "fields, directories that are not versions, missing model files, dims and "
                    "data types against the ONNX graph, unknown or mismatched backend and "
                    "platform, names, and the fields shmserve refuses (errors) or ignores "
                    "(warnings). Exit status 0 when there is no error (warnings are printed), "
                    "1 with errors, 2 when DIR is not a directory.")
    v.add_argument("dir", metavar="DIR", help="the model repository")
    v.add_argument("--json", action="store_true",
                   help="print the findings as JSON: [{model, version, file, line, severity, "
                        "message, fix}], severity error, warning or info")
    v.add_argument("--disable-auto-complete-config", action="store_true",
                   help="as `serve`'s: every model needs a complete config.pbtxt (no python "
                        "auto_complete_config hook runs)")
    v.add_argument("--strict-model-config", type=_bool, default=False, nargs="?", const=True,
                   metavar="BOOL", help="Triton's older spelling: true is "
                   "--disable-auto-complete-config")
    v.set_defaults(fn=cmd_validate)

    m = sub.add_parser("models", help="list loaded models, their state and statistics")
    m.add_argument("--name", default=DEFAULT_NAME)
    m.set_defaults(fn=cmd_models)

    st = sub.add_parser("stats", help="Triton's statistics extension: per model version "
                        "counts and durations (--json: the extension's JSON)")
    st.add_argument("--name", default=DEFAULT_NAME)
    st.add_argument("--model", default=None, help="one model (default: every model)")
    st.add_argument("--version", type=int, default=None, help="one version of --model")
    st.add_argument("--json", action="store_true", help="print the JSON response")
    st.set_defaults(fn=cmd_stats)

    lo = sub.add_parser("load", help="load (or reload) a model: --model-control-mode explicit")
    lo.add_argument("model")
    lo.add_argument("--config", default=None, metavar="JSON",
                    help="the model configuration as JSON, used instead of config.pbtxt "
                         "(Triton's load API `config` parameter)")
    lo.add_argument("--name", default=DEFAULT_NAME)
    lo.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for the load (default 600)")
    lo.set_defaults(fn=cmd_load)

    un = sub.add_parser("unload", help="unload a model: its requests in flight finish, new "
                        "ones are refused (--model-control-mode explicit)")
    un.add_argument("model")
    un.add_argument("--name", default=DEFAULT_NAME)
    un.add_argument("--unload-dependents", action="store_true",
                    help="also unload the ensembles that call the model (Triton's "
                         "unload_dependents)")
    un.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for the unload (default 600)")
    un.set_defaults(fn=cmd_unload)

    ix = sub.add_parser("index", help="Triton's repository index: every model of the "
                        "repository, each version's state and reason")
    ix.add_argument("--name", default=DEFAULT_NAME)
    ix.add_argument("--ready", action="store_true", help="only the READY versions")
    ix.add_argument("--json", action="store_true", help="print Triton's JSON answer")
    ix.set_defaults(fn=cmd_index)

    ts = sub.add_parser("trace-summary", help="summarize trace files of --trace-config "
                        "(what Triton's trace_summary.py prints)")
    ts.add_argument("file", nargs="+", help="trace file(s) in Triton's JSON")
    ts.set_defaults(fn=cmd_trace_summary)

    h = sub.add_parser(
        "health", help="is the server live (or ready)? exit 0 yes, 1 not ready, 2 no server",
        description="Triton's health checks, for probes and scripts: live = the server "
                    "answers on its control socket; ready = live and every model (or the "
                    "--model given) is READY (a server started with --strict-readiness=false "
                    "is ready while it is live). Exit status 0 healthy, 1 live but not ready "
                    "(a model LOADING or UNAVAILABLE, an unknown model), 2 no server (not "
                    "running, dead, refused, or no answer within --timeout). Opens no lease.")
    h.add_argument("--name", default=DEFAULT_NAME)
    h.add_argument("--ready", action="store_true",
                   help="also require the server to be ready (Triton's /v2/health/ready): every "
                        "model READY, unless it serves with --strict-readiness=false")
    h.add_argument("--model", default=None,
                   help="require this model to be READY (Triton's /v2/models/M/ready)")
    h.add_argument("--version", type=int, default=None,
                   help="with --model: this version (default the highest)")
    h.add_argument("--timeout", type=float, default=5.0,
                   help="seconds the whole check may take (default 5)")
    h.add_argument("--quiet", "-q", action="store_true", help="print nothing when healthy")
    h.set_defaults(fn=cmd_health)

    sv = sub.add_parser(
        "status", help="a live view of the server: models, rates, latencies, clients",
        description="Refreshes every --interval seconds: the server (uptime, ring depth, "
                    "clients, batcher, restarts, wake-ups), one row per model version "
                    "(state, instances busy, pending requests, inferences and requests per "
                    "second, p50/p99 request latency and mean queue and compute time over "
                    "the last interval, failures by reason) and one per client (slots in "
                    "use, bytes in flight, arena). Opens no lease. --once prints one frame "
                    "(rates over two samples --interval apart) and exits: 0, or 2 when no "
                    "server answers, as `shmserve health`.")
    sv.add_argument("--name", default=DEFAULT_NAME)
    sv.add_argument("--interval", type=float, default=1.0, metavar="S",
                    help="seconds between refreshes (default 1)")
    sv.add_argument("--once", action="store_true",
                    help="print one frame and exit (for scripts)")
    sv.add_argument("--timeout", type=float, default=5.0,
                    help="seconds the server has to answer each refresh (default 5)")
    sv.set_defaults(fn=cmd_status)

    i = sub.add_parser("infer", help="send one request and print outputs and latency")
    i.add_argument("model")
    i.add_argument("--input", action="append", default=[], metavar="NAME=file.npy|random|zeros")
    i.add_argument("--shape", action="append", default=[], metavar="NAME=d1,d2",
                   help="shape (without batch) for inputs with -1 dims")
    i.add_argument("--batch", type=int, default=1, help="batch size for generated inputs")
    i.add_argument("--version", type=int, default=None)
    i.add_argument("--repeat", type=int, default=1, help="send it this many times (latency)")
    i.add_argument("--name", default=DEFAULT_NAME)
    i.set_defaults(fn=cmd_infer)

    from shmserve_bench.cli import add_arguments as bench_arguments

    b = sub.add_parser("bench", help="latency and throughput benchmark (perf_analyzer's flags)")
    bench_arguments(b)
    b.set_defaults(fn=cmd_bench)

    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except ShmServeError as e:
        print(f"shmserve: {type(e).__name__}: {e.msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
