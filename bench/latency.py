#!/usr/bin/env python3
"""Round-trip latency of shmserve at concurrency 1, next to its references.

One run measures, one after the other (never two at the same time):

  1. references: a two-process futex ping-pong (shmserve's own doorbell_ring /
     doorbell_wait on an anonymous shared mapping) and two 1 MiB numpy copies;
  2. shmserve: a private server on the bundled model repository, the `identity`
     model at 4 KiB and 1 MiB, three client variants (copy in / zero-copy in /
     copy out), every request timed, a sample of answers checked bit-exact;
  3. optionally the real Triton 2.51 server of the peer kit (shared/peers), with
     its own bench.py (http, grpc, grpc + system shared memory).

Steps 1 and 2 are repeated --repeats times; the report gives the median of each
statistic over the repeats and the spread of p50. It is written as markdown to
stdout and to --out, with the raw numbers in a .json file beside it.

    python bench/latency.py                          # defaults, about 3-5 minutes
    python bench/latency.py --requests 2000 --repeats 1 --triton-duration 2

Nothing here asserts on time: the report states the DESIGN.md targets and
whether this run met them.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import mmap
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from shmserve_bench.harness import ServerProcess, poll_until

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path("/work/shared/peers")
PEERS_PY = Path("/tmp/peers-venv/bin/python")
PEERS_WORK = Path(os.environ.get("PEERS_WORK", "/tmp/peers-work"))
TRITON_HTTP_PORT = 18000

SIZES = {"4KiB": 1024, "1MiB": 262144}  # FP32 elements of INPUT0 [1, n]
TRITON_MODEL = {"4KiB": "identity4k", "1MiB": "identity1m"}
VARIANTS = {
    "a": "copy=False, numpy input (one copy in, views out, release())",
    "b": "copy=False, input from client.empty() (zero-copy in)",
    "c": "copy=True (one copy in, outputs copied out)",
}
TARGETS = [("4KiB", "p50", 40.0), ("4KiB", "p99", 150.0), ("1MiB", "p50", 150.0)]
STAGES = [  # (label, from stamp, to stamp); "call"/"return" are this process's perf_counter_ns
    ("call -> CLIENT_WRITE (plan, arena block, input copy)", "call", "CLIENT_WRITE"),
    ("CLIENT_WRITE -> ENQUEUE (descriptor, ring push)", "CLIENT_WRITE", "ENQUEUE"),
    ("ENQUEUE -> DEQUEUE (doorbell, batcher wakes)", "ENQUEUE", "DEQUEUE"),
    ("DEQUEUE -> BATCHED (batcher forms the batch)", "DEQUEUE", "BATCHED"),
    ("BATCHED -> COMPUTE_START (worker wakes, reads)", "BATCHED", "COMPUTE_START"),
    ("COMPUTE_START -> COMPUTE_END (model)", "COMPUTE_START", "COMPUTE_END"),
    ("COMPUTE_END -> COMPLETE (outputs, publish)", "COMPUTE_END", "COMPLETE"),
    ("COMPLETE -> CLIENT_WAKE (client wakes)", "COMPLETE", "CLIENT_WAKE"),
    ("CLIENT_WAKE -> return (result objects)", "CLIENT_WAKE", "return"),
]
PERCENTILES = {"p50": 50, "p90": 90, "p99": 99, "p99.9": 99.9}


# ----------------------------------------------------------------------------- statistics
def summarize(lat_ns: np.ndarray, wall_s: float | None = None) -> dict:
    """Percentiles and mean in microseconds; requests/s over the timed loop."""
    us = lat_ns / 1000.0
    out = {k: float(np.percentile(us, q)) for k, q in PERCENTILES.items()}
    out["mean"] = float(us.mean())
    out["n"] = int(len(us))
    if wall_s:
        out["rps"] = len(us) / wall_s
    return out


def stage_medians(call_ns: np.ndarray, ret_ns: np.ndarray, stamps: np.ndarray,
                  same_clock: bool) -> dict:
    """Median of each stage in microseconds (only where both ends were stamped)."""
    from shmserve.protocol import Timestamp

    cols = {t.name: stamps[:, int(t)] for t in Timestamp}
    if same_clock:
        cols["call"], cols["return"] = call_ns, ret_ns
    out = {}
    for label, a, b in STAGES:
        if a not in cols or b not in cols:
            continue
        ok = (cols[a] > 0) & (cols[b] > 0)
        if ok.any():
            out[label] = float(np.median(cols[b][ok] - cols[a][ok])) / 1000.0
    return out


def median_over_repeats(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    out = {k: float(np.median([r[k] for r in runs])) for k in keys}
    out["p50_min"] = min(r["p50"] for r in runs)
    out["p50_max"] = max(r["p50"] for r in runs)
    out["repeats"] = len(runs)
    return out


# ----------------------------------------------------------------------------- machine
def cpu_ticks() -> tuple[int, int, int]:
    """(all, idle + iowait, steal) ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(v), v[3] + v[4], v[7]


def cpu_use(t0: tuple, t1: tuple) -> dict:
    """Busy and steal (time the hypervisor gave to others) between two cpu_ticks(),
    in % of one core."""
    total = (t1[0] - t0[0]) or 1
    cores = os.cpu_count() or 1
    return {"busy_pct_of_one_core": round(100.0 * (total - (t1[1] - t0[1])) / total * cores, 1),
            "steal_pct_of_one_core": round(100.0 * (t1[2] - t0[2]) / total * cores, 1)}


def background_load(seconds: float = 1.0) -> dict:
    """loadavg and a `seconds` sample of busy and stolen CPU, with nothing of ours running."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    t0 = cpu_ticks()
    time.sleep(seconds)
    return {"loadavg": load, **cpu_use(t0, cpu_ticks())}


def machine_info() -> dict:
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def git(*args):
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else "?"
    dirty = git("status", "--porcelain", "--", "shmserve")
    return {
        "nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cpu_model": model,
        "kernel": platform.release(), "python": platform.python_version(),
        "numpy": np.__version__, "shmserve_commit": git("rev-parse", "--short", "HEAD"),
        "shmserve_dirty": bool(dirty),
    }


# ----------------------------------------------------------------------------- references
def futex_pingpong(iters: int, spin_ns: int) -> dict:
    """Round trips between this process and a forked child over two doorbells
    (words at offsets 0/4: parent -> child, 8/12: child -> parent)."""
    from shmserve._core import Mapping

    buf = mmap.mmap(-1, 4096)  # anonymous, MAP_SHARED: the child sees the same page
    ops = Mapping(buf)
    total = iters + iters // 10 + 1
    pid = os.fork()
    if pid == 0:  # child: answer each ring of word 0 with a ring of word 8
        code = 0
        try:
            seen = 0
            for _ in range(total):
                if not ops.doorbell_wait(0, 4, seen, spin_ns, 5_000_000_000):
                    code = 1
                    break
                seen = (seen + 1) & 0xFFFFFFFF
                ops.doorbell_ring(8, 12)
        finally:
            os._exit(code)
    lat = np.empty(total, np.int64)
    try:
        for i in range(total):
            seen = ops.load32(8)
            t0 = time.perf_counter_ns()
            ops.doorbell_ring(0, 4)
            if not ops.doorbell_wait(8, 12, seen, spin_ns, 5_000_000_000):
                raise RuntimeError("futex ping-pong: the child did not answer within 5 s")
            lat[i] = time.perf_counter_ns() - t0
    finally:
        _, status = os.waitpid(pid, 0)
        ops.release()
        buf.close()
    if status:
        raise RuntimeError(f"futex ping-pong child exited with status {status}")
    return summarize(lat[total - iters:])


def two_copies(iters: int, nbytes: int = 1 << 20) -> dict:
    """np.copyto twice per iteration: what one copy in and one copy out cost."""
    src = np.random.default_rng(1).standard_normal(nbytes // 4).astype(np.float32)
    mid, dst = np.ones_like(src), np.ones_like(src)
    lat = np.empty(iters + iters // 10, np.int64)
    for i in range(len(lat)):
        t0 = time.perf_counter_ns()
        np.copyto(mid, src)
        np.copyto(dst, mid)
        lat[i] = time.perf_counter_ns() - t0
    if not np.array_equal(dst, src):
        raise RuntimeError("two_copies: copy mismatch")
    return summarize(lat[iters // 10:])


def references(args) -> dict:
    return {
        "futex ping-pong (spin 0)": futex_pingpong(args.pingpong_iters, 0),
        f"ping-pong, spin {args.client_spin_us} us then futex":
            futex_pingpong(args.pingpong_iters, args.client_spin_us * 1000),
        "two 1 MiB copies (np.copyto x2)": two_copies(args.copy_iters),
    }


# ----------------------------------------------------------------------------- shmserve server
def bench_server(repo: Path, log_path: Path, spin_us: int | None) -> ServerProcess:
    """A private server (shmserve_bench.harness: own runtime dir, own process group),
    not started yet. Its runtime dir goes into this process's environment, so that
    Client(name) here, the benchmark's client processes and the C++ client find it."""
    server = ServerProcess(repo, log_path=log_path, name_prefix="bench-",
                           args=[] if spin_us is None else ["--spin-us", str(spin_us)])
    os.environ["SHMSERVE_RUNTIME_DIR"] = str(server.runtime_dir)
    return server


def stop_server(server: ServerProcess) -> list[str]:
    """Stops it (SIGTERM, a clean shutdown); notes on anything unclean, which the
    harness has cleaned up (processes, segments in /dev/shm)."""
    notes = server.teardown()
    if server.returncode not in (None, 0, -signal.SIGTERM):
        notes.append(f"server exit status {server.returncode}")
    return notes


def ensure_models(repo: Path) -> None:
    if not (repo / "mlp" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_models.py"), str(repo)],
                       check=True)


# ----------------------------------------------------------------------------- shmserve runs
class Mismatch(Exception):
    pass


def _check(out: np.ndarray, expected: np.ndarray, what: str) -> None:
    if out.shape != expected.shape or out.dtype != expected.dtype or \
            not np.array_equal(out.view(np.uint32), expected.view(np.uint32)):
        raise Mismatch(f"{what}: answer differs from the input "
                       f"(shape {out.shape}, dtype {out.dtype})")


def measure_variant(client, variant: str, n_elems: int, args) -> dict:
    """Times warm-up + `requests` identity calls; returns the summary, per-request
    stamps and stage medians. Every validate_every-th request gets a new tag in its
    first and last element and its answer is compared bit-exact with the input."""
    rng = np.random.default_rng(n_elems)
    if variant == "b":
        inp = client.empty((1, n_elems), np.float32)
        inp[...] = rng.standard_normal((1, n_elems), dtype=np.float32)
    else:
        inp = rng.standard_normal((1, n_elems), dtype=np.float32)
    copy = variant == "c"
    inputs = {"INPUT0": inp}
    warm, n = args.warmup_requests, args.requests
    total = warm + n
    call = np.empty(total, np.int64)
    ret = np.empty(total, np.int64)
    stamps = np.zeros((total, 8), np.int64)
    checked = 0
    t_start = 0
    for i in range(total):
        if i == warm:
            t_start = time.perf_counter_ns()
        check = i % args.validate_every == 0
        if check:
            inp[0, 0] = inp[0, -1] = float(i)
        t0 = time.perf_counter_ns()
        res = client.infer("identity", inputs, copy=copy)
        t1 = time.perf_counter_ns()
        call[i], ret[i] = t0, t1
        stamps[i] = res.timestamps_ns
        if check:
            _check(res["OUTPUT0"], inp, f"variant ({variant}) {n_elems * 4} B request {i}")
            checked += 1
        if not copy:
            res.release()
        del res
    wall_s = (time.perf_counter_ns() - t_start) / 1e9
    lat = (ret - call)[warm:]
    same_clock = "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation
    return {"summary": summarize(lat, wall_s), "checked": checked,
            "stages": stage_medians(call[warm:], ret[warm:], stamps[warm:], same_clock)}


def shmserve_repeat(client, args) -> dict:
    """One pass over every size and variant."""
    out = {}
    for size, n_elems in SIZES.items():
        for variant in VARIANTS:
            out[f"{size}/{variant}"] = measure_variant(client, variant, n_elems, args)
    return out


def server_stats(client) -> dict:
    with contextlib.suppress(Exception):
        for s in client.statistics("identity"):
            return {"request_success": s["inference_stats"]["success"]["count"],
                    "request_failure": s["inference_stats"]["fail"]["count"],
                    "execution_count": s["execution_count"],
                    "batch_requests": s["shmserve"]["batch_requests"]}
    return {}


# ----------------------------------------------------------------------------- Triton
def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_triton(args, jsonl: Path) -> tuple[list[dict], list[str]]:
    """Starts Triton with the peer kit, runs its bench.py at concurrency 1 for the
    identity models, always stops it. Returns (rows, notes)."""
    if port_open(TRITON_HTTP_PORT):
        return [], [f"port {TRITON_HTTP_PORT} already in use (someone else's server?): Triton skipped"]
    notes = []
    triton_sh = ["bash", str(PEERS / "triton.sh")]
    try:
        first_setup = not PEERS_PY.exists()  # triton.sh start runs the kit's setup.sh then
        r = subprocess.run([*triton_sh, "start"], capture_output=True, text=True,
                           timeout=1200 if first_setup else 180)
        if r.returncode != 0:
            return [], [f"triton.sh start failed: {(r.stderr or r.stdout).strip()[-400:]}"]
        pgid = int((PEERS_WORK / "triton.pid").read_text().strip())
        cmd = [str(PEERS_PY), str(PEERS / "bench.py"), "run", "--server", "triton",
               "--out", str(jsonl), "--duration", str(args.triton_duration),
               "--warmup", str(args.triton_warmup), "--conc", "1",
               "--models", "identity4k,identity1m", "--shm", "grpc", "--server-pgid", str(pgid)]
        timeout = 6 * (args.triton_duration + args.triton_warmup) + 120
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            notes.append(f"bench.py exited {r.returncode}: {r.stderr.strip()[-400:]}")
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        notes.append(f"Triton run failed: {type(e).__name__}: {e}")
    finally:
        subprocess.run([*triton_sh, "stop"], capture_output=True, text=True, timeout=60)
    rows = []
    if jsonl.exists():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return rows, notes


def triton_p50(rows: list[dict], size: str, transport: str = "grpc+sysshm") -> float | None:
    for r in rows:
        if r["model"] == TRITON_MODEL[size] and r["transport"] == transport:
            return r["p50"]
    return None


# ----------------------------------------------------------------------------- report
def f(v, nd=1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def render(res: dict) -> str:
    m, a = res["machine"], res["args"]
    L = [f"# shmserve latency, concurrency 1 ({res['started_utc']})", ""]
    L += ["```", res["command"], "```", ""]
    L += [f"- machine: {m['nproc']} CPUs ({m['affinity']} usable), {m['cpu_model']}, "
          f"kernel {m['kernel']}, Python {m['python']}, numpy {m['numpy']}",
          f"- shmserve {m['shmserve_commit']}{' + uncommitted changes in shmserve/' if m['shmserve_dirty'] else ''}; "
          f"server spin: {a['spin_us'] if a['spin_us'] is not None else 'server default'}",
          f"- background load (1 s samples, % of one core) before: loadavg "
          f"{res['load_before']['loadavg']}, busy {res['load_before']['busy_pct_of_one_core']} %, "
          f"steal {res['load_before']['steal_pct_of_one_core']} %; after: loadavg "
          f"{res['load_after']['loadavg']}, busy {res['load_after']['busy_pct_of_one_core']} %, "
          f"steal {res['load_after']['steal_pct_of_one_core']} %; steal during the shmserve + "
          f"reference phase: {res['steal_during']['steal_pct_of_one_core']} % of one core",
          "- the futex ping-pong p50 (DESIGN.md reference run: 12 us) is the most direct in-run "
          "sign of disturbance: a high value or a wide range means this run was disturbed",
          f"- shmserve: {a['requests']:,} timed requests per row after {a['warmup_requests']:,} "
          f"warm-up, {a['repeats']} repeat(s) (median of each statistic over repeats; p50 range = "
          f"min..max over repeats); every {a['validate_every']}th answer checked bit-exact",
          f"- total wall time {res['wall_s']:.0f} s", ""]
    L += ["## shmserve identity round trip (us)", "",
          "| size | variant | p50 | p90 | p99 | p99.9 | mean | req/s | p50 range | checked |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for key, s in res["shmserve"].items():
        size, v = key.split("/")
        L.append(f"| {size} | ({v}) {VARIANTS[v]} | {f(s['p50'])} | {f(s['p90'])} | {f(s['p99'])} "
                 f"| {f(s['p99.9'])} | {f(s['mean'])} | {f(s.get('rps'), 0)} "
                 f"| {f(s['p50_min'])}..{f(s['p50_max'])} | {s['checked']} |")
    L += ["", "## References (same run, us)", "", "| what | p50 | p90 | p99 | p99.9 | p50 range |",
          "|---|---|---|---|---|---|"]
    for name, s in res["references"].items():
        L.append(f"| {name} | {f(s['p50'])} | {f(s['p90'])} | {f(s['p99'])} | {f(s['p99.9'])} "
                 f"| {f(s['p50_min'])}..{f(s['p50_max'])} |")
    L += ["", "## Triton 2.51 (peer kit bench.py, concurrency 1)", ""]
    if res["triton"]:
        L += ["| model | transport | p50 us | p90 us | p99 us | infer/s | errors | n | other CPU% |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in res["triton"]:
            L.append(f"| {r['model']} | {r['transport']} | {f(r['p50'])} | {f(r['p90'])} "
                     f"| {f(r['p99'])} | {f(r['throughput'], 0)} | {r['errors']} | {r['n']} "
                     f"| {f(r.get('other_cpu_pct'), 0)} |")
    else:
        L.append("not run" + (": " + "; ".join(res["triton_notes"]) if res["triton_notes"] else ""))
    L += ["", "## Ratios (p50 / p50)", "", "| size | Triton grpc+sysshm / shmserve (a) "
          "| shmserve (a) / futex ping-pong | shmserve (a) / two 1 MiB copies |", "|---|---|---|---|"]
    for size, r in res["ratios"].items():
        L.append(f"| {size} | {f(r['triton_over_shmserve'], 2)} | {f(r['shmserve_over_pingpong'], 2)} "
                 f"| {f(r['shmserve_over_copies'], 2)} |")
    L += ["", "## DESIGN.md targets", "", "| target | (a) | (b) | (c) |", "|---|---|---|---|"]
    for t in res["targets"]:
        cells = [f"{f(t[v]['value'])} us {'met' if t[v]['met'] else '**not met**'}" for v in VARIANTS]
        L.append(f"| {t['size']} {t['stat']} <= {t['limit']:.0f} us | " + " | ".join(cells) + " |")
    L += ["", "## Where the time goes: variant (a), median of each stage (us)", "",
          "Medians of stages do not add up to the median round trip. CLOCK_MONOTONIC throughout.", "",
          "| stage | " + " | ".join(SIZES) + " |", "|---|" + "---|" * len(SIZES)]
    for label, *_ in STAGES:
        vals = [res["stages"].get(size, {}).get(label) for size in SIZES]
        if any(v is not None for v in vals):
            L.append(f"| {label} | " + " | ".join(f(v) for v in vals) + " |")
    L += ["", "## Notes", ""]
    L += [f"- {n}" for n in res["notes"]]
    L += [f"- server statistics (identity): {json.dumps(res['server_stats'])}",
          f"- shmserve segments in /dev/shm with the client connected: "
          f"{len(res.get('segments_with_client', []))}, after it closed: "
          f"{len(res.get('segments_after_client_close', []))}, when the server was stopped: "
          f"{len(res.get('segments_after_stop', []))}", ""]
    return "\n".join(L)


def ratios_and_targets(res: dict) -> None:
    ping = res["references"]["futex ping-pong (spin 0)"]["p50"]
    copies = res["references"]["two 1 MiB copies (np.copyto x2)"]["p50"]
    res["ratios"], res["targets"] = {}, []
    for size in SIZES:
        a = res["shmserve"].get(f"{size}/a", {}).get("p50")
        t = triton_p50(res["triton"], size)
        res["ratios"][size] = {
            "triton_over_shmserve": t / a if t and a else None,
            "shmserve_over_pingpong": a / ping if a else None,
            "shmserve_over_copies": a / copies if a and size == "1MiB" else None,
        }
    for size, stat, limit in TARGETS:
        row = {"size": size, "stat": stat, "limit": limit}
        for v in VARIANTS:
            value = res["shmserve"].get(f"{size}/{v}", {}).get(stat)
            row[v] = {"value": value, "met": value is not None and value <= limit}
        res["targets"].append(row)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000, help="timed requests per size and variant")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: requests/10, at least 200")
    p.add_argument("--repeats", type=int, default=3, help="passes over references + shmserve")
    p.add_argument("--validate-every", type=int, default=1000, help="check every Nth answer bit-exact")
    p.add_argument("--pingpong-iters", type=int, default=20_000)
    p.add_argument("--copy-iters", type=int, default=5_000)
    p.add_argument("--spin-us", type=int, default=None, help="server --spin-us (default: server's)")
    p.add_argument("--client-spin-us", type=int, default=None,
                   help="Client(spin_us=...) and the spinning ping-pong (default: client's SPIN_US)")
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    tr = p.add_mutually_exclusive_group()
    tr.add_argument("--triton", dest="triton", action="store_true", default=None,
                    help="run Triton (default: when /tmp/peers-venv exists)")
    tr.add_argument("--no-triton", dest="triton", action="store_false")
    p.add_argument("--triton-duration", type=float, default=10.0, help="seconds measured per row")
    p.add_argument("--triton-warmup", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=None,
                   help="markdown report (default bench/out/latency-<UTC>.md); .json beside it")
    args = p.parse_args(argv)
    if args.warmup_requests is None:
        args.warmup_requests = max(200, args.requests // 10)
    if args.triton is None:
        args.triton = PEERS_PY.exists()
    if args.client_spin_us is None:
        from shmserve.client.client import SPIN_US
        args.client_spin_us = SPIN_US
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop both servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = dt.datetime.now(dt.timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out_md = args.out or ROOT / "bench" / "out" / f"latency-{stamp}.md"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    res = {"started_utc": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
           "command": shlex.join([sys.executable, *sys.argv]),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "machine": machine_info(), "load_before": background_load(), "notes": [],
           "triton": [], "triton_notes": [], "server_stats": {}}
    print(f"shmserve latency benchmark -> {out_md}", file=sys.stderr)
    ticks = cpu_ticks()
    ok = run_shmserve_and_refs(args, res, out_md.with_suffix(".server.log"))
    res["steal_during"] = cpu_use(ticks, cpu_ticks())
    if args.triton and ok:
        print("Triton (peer kit) ...", file=sys.stderr)
        res["triton"], res["triton_notes"] = run_triton(args, out_md.with_suffix(".triton.jsonl"))
        res["notes"] += [f"Triton: {n}" for n in res["triton_notes"]]
        if any(r.get("errors") for r in res["triton"]):
            res["notes"].append("Triton rows report errors (see the table)")
    res["load_after"] = background_load()
    res["wall_s"] = time.monotonic() - t_begin
    if ok:
        ratios_and_targets(res)
        report = render(res)
        out_md.write_text(report)
        print(report)
    out_md.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out_md if ok else '(no report)'} and {out_md.with_suffix('.json')}",
          file=sys.stderr)
    if not ok:
        print("FAILED: " + "; ".join(res["notes"]), file=sys.stderr)
    return 0 if ok else 1


def run_shmserve_and_refs(args, res: dict, log_path: Path) -> bool:
    """references + shmserve, --repeats times, against one private server."""
    from shmserve import Client

    ensure_models(args.model_repository)
    server = bench_server(args.model_repository, log_path, args.spin_us)
    refs, shm = [], []
    ok = True
    try:
        server.start(timeout=60)
        with Client(server.name, arena_bytes=16 << 20, spin_us=args.client_spin_us) as client:
            for r in range(args.repeats):
                print(f"repeat {r + 1}/{args.repeats}: references ...", file=sys.stderr)
                refs.append(references(args))
                print(f"repeat {r + 1}/{args.repeats}: shmserve ...", file=sys.stderr)
                shm.append(shmserve_repeat(client, args))
            res["server_stats"] = server_stats(client)
            res["segments_with_client"] = server.segments()
        # the server ends the lease (closes the arena) when it sees the socket close
        if not poll_until(lambda: not server.arenas(), 5.0):
            res["notes"].append("shmserve: the coordinator still held the client's arena "
                                "5 s after the client closed")
        res["segments_after_client_close"] = server.segments()
        if res["segments_after_client_close"]:
            res["notes"].append("shmserve: /dev/shm segments of the server's own after the "
                                f"client closed (expected none): {res['segments_after_client_close']}")
    except Exception as e:  # noqa: BLE001 - reported, and the server is stopped below
        ok = False
        res["notes"].append(f"shmserve run failed: {type(e).__name__}: {e}")
    finally:
        res["notes"] += [f"shmserve: {n}" for n in stop_server(server)]
        res["segments_after_stop"] = server.leftover
        if server.record is None and server.proc is not None:
            res["notes"].append("shmserve: the server never answered: /dev/shm was not checked")
    if not ok or not shm:
        return False
    res["references"] = {k: median_over_repeats([r[k] for r in refs]) for k in refs[0]}
    res["shmserve"], res["stages"] = {}, {}
    for key in shm[0]:
        runs = [r[key] for r in shm]
        res["shmserve"][key] = {**median_over_repeats([x["summary"] for x in runs]),
                                "checked": sum(x["checked"] for x in runs)}
        size, variant = key.split("/")
        if variant == "a":
            res["stages"][size] = {label: float(np.median([x["stages"][label] for x in runs
                                                           if label in x["stages"]]))
                                   for label in runs[0]["stages"]}
    res["raw"] = {"references": refs, "shmserve": [{k: {"summary": v["summary"], "stages": v["stages"]}
                                                    for k, v in r.items()} for r in shm]}
    return True


if __name__ == "__main__":
    sys.exit(main())
