#!/usr/bin/env python3
"""The bench suite: every DESIGN.md target in one run, then bench/RESULTS.md.

    .venv/bin/python bench/run_all.py                 # about 7-8 minutes on 2 cores
    .venv/bin/python bench/run_all.py --repeats 1 --no-triton     # quick look

Each repeat, one server at a time (never two measurements at once):

1. references: two-process futex ping-pong and two 1 MiB copies (bench/latency.py);
2. shmserve (a private server on model_repository/): identity FP32 [1,1024] (4 KiB)
   and [1,262144] (1 MiB) at concurrency 1; mlp FP32 [1,256] at 1/8/32 callers;
   after each mlp level, bare onnxruntime (same model.onnx, intra_op 1) timed on
   the batch sizes the server formed in that level (its statistics' batch
   histogram): the ceiling at those batch sizes;
   identity 4 KiB again under contention: one CPU-bound busy process per core for
   the length of that run (shmserve_bench.contention), stopped whatever happens;
   the Python client in a plain loop, then the C++ client (clients/cpp's
   shmserve_latency), at identity 4 KiB right after the harness's Python run, and
   each client alone at mlp with 32 in flight from one thread;
3. Triton 2.51 from shared/peers (when /tmp/peers-venv exists): the same scenarios
   over gRPC (+ system shared memory for identity), same harness, same settings,
   identity 4 KiB over gRPC + shm under contention too;
4. once, after the repeats: the metrics cost (bench/metrics_cost.py): identity 4 KiB
   with --metrics-port scraped every second against no metrics, interleaved pairs.

Every level reports CPU per request: the client's, and the server's by process role
(coordinator, batcher, workers) with the model's execution time taken out
(shmserve_bench.cost); the C++ client's from its rusage.

Ratios are computed within each repeat, then the median over repeats is reported.
The machine is shared and noisy: load before and after and each level's machine
CPU are in the report. Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import client_cost as CC  # noqa: E402  (the Python client's loops without the harness)
import latency as L  # noqa: E402  (server control, machine info, references)
import metrics_cost as MC  # noqa: E402
from shmserve_bench import BenchConfig, report, run_benchmark  # noqa: E402
from shmserve_bench import cost as C  # noqa: E402
from shmserve_bench.contention import BusyLoad  # noqa: E402
from shmserve_bench.runner import model_row  # noqa: E402
from shmserve_bench.ceiling import ort_ceiling  # noqa: E402
from shmserve_bench import plot as PL  # noqa: E402
from shmserve_bench import stats as S  # noqa: E402

TRITON_GRPC = "127.0.0.1:18001"
IDENTITY = {"4KiB": 1024, "1MiB": 262144}
MLP_CALLERS = [1, 8, 32]
TARGETS = {"4KiB": {"p50": 40.0, "p99": 150.0}, "1MiB": {"p50": 150.0}}
TWO_COPIES = "two 1 MiB copies (np.copyto x2)"  # bench/latency.py's reference row
CPP_REQUESTS, CPP_WARMUP = 20000, 1000
# The C++ client's own work per request: its spin is CPU by design (it waits on the CPU
# for the fastest answer), so a run with spinning off shows the rest (issue 9: <= 3 us;
# the Python client's counterpart is bench/client_cost.py).
NO_SPIN = ", spin off"
CPP_MODES = ("copied input", "zero-copy input", "copied input" + NO_SPIN)
# Issue 9's client targets at MLP with 32 in flight, each client alone in one thread of
# one process with no harness (client_cost.py's "submit 32"; shmserve_latency
# --concurrency 32): Python <= 10 us, C++ <= 3 us of CPU per request.
MLP_IN_FLIGHT, MLP_CLIENT_S, MLP_CPP_REQUESTS = 32, 3.0, 40000
CLIENT_TARGETS = {"Python": 10.0, "C++": 3.0}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cfg(args, model, url, **kw) -> BenchConfig:
    base = dict(model=model, url=url, measurement_interval_s=args.window_ms / 1000.0,
                warmup_s=args.warmup, max_trials=args.max_trials, stability_pct=10.0,
                progress=say if args.verbose else None)
    base.update(kw)
    return BenchConfig(**base)


def run_identity(args, url: str, size: str, label: str, **kw):
    c = cfg(args, "identity", url, shapes={"INPUT0": [IDENTITY[size]]}, concurrency=[1],
            target_options={"arena_bytes": 16 << 20} if url.startswith("shm://") else {}, **kw)
    (tr,) = run_benchmark(c)
    tr.label = f"{label} identity {size}"
    return tr


def run_mlp(args, url: str, label: str, **kw):
    trs = []
    for callers in MLP_CALLERS:
        c = cfg(args, "mlp", url, concurrency=[callers], processes=1 if callers == 1 else 2, **kw)
        (tr,) = run_benchmark(c)
        trs.append(tr)
    merged = trs[0]
    for tr in trs[1:]:
        merged.levels += tr.levels
        merged.error = merged.error or tr.error
    merged.label = f"{label} mlp"
    return merged


def build_cpp_latency() -> Path | None:
    """Builds clients/cpp's shmserve_latency once into bench/out/cpp-build; None when
    cmake, g++ or the msgpack headers are missing (README, "C++ client")."""
    build = BENCH / "out" / "cpp-build"
    exe = build / "shmserve_latency"
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        return None
    for cmd in (["cmake", "-S", str(ROOT / "clients" / "cpp"), "-B", str(build),
                 "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(build), "--target", "shmserve_latency", "-j2"]):
        if subprocess.run(cmd, capture_output=True, timeout=600).returncode:
            return None
    return exe if exe.exists() else None


def cpp_latency(exe: Path, server, zero_copy: bool, sampler: C.ServerSampler | None,
                spin_us: int | None = None, extra: tuple = (),
                requests: int = CPP_REQUESTS) -> dict | None:
    """identity 4 KiB, 1 caller, through the C++ client against the same server (extra:
    other shmserve_latency arguments, e.g. another model and --concurrency); with the
    client's CPU per request (its rusage, start-up and warm-up included, over all the
    requests it sent; and its own figure over the timed requests only) and the server's
    by role over the same stretch (when sampler is given). spin_us: the client's spin
    (None: its default)."""
    cmd = [str(exe), "--name", server.name, "--requests", str(requests),
           "--warmup", str(CPP_WARMUP), *extra] + \
        ([] if spin_us is None else ["--spin-us", str(spin_us)])
    a, cpu0 = sampler.sample() if sampler else None, C.child_cpu_s()
    r = subprocess.run(cmd + (["--zero-copy"] if zero_copy else []), capture_output=True,
                       text=True, timeout=300, env=server.env())
    b, cpu1 = sampler.sample() if sampler else None, C.child_cpu_s()
    m = re.search(r"p50 ([\d.]+) us\s+p90 ([\d.]+) us\s+p99 ([\d.]+) us", r.stdout)
    if not m:
        return None
    sent = requests + CPP_WARMUP
    timed = re.search(r"cpu ([\d.]+) us/request", r.stdout)  # the timed requests' own
    return {"p50": float(m[1]), "p90": float(m[2]), "p99": float(m[3]),
            "client_us": 1e6 * (cpu1 - cpu0) / sent,
            "server": C.server_cost(a, b, sent) if sampler else None,
            "client_timed_us": float(timed[1]) if timed else None}


def python_plain_latency(server, requests: int = CPP_REQUESTS) -> dict:
    """identity 4 KiB, 1 caller, through the Python client in a plain loop in this
    process (client_cost.timed_loop), timed as shmserve_latency times the C++ client's:
    the like-for-like Python row of the Python / C++ ratio."""
    from shmserve.client import Client

    client = Client(server.name, arena_bytes=16 << 20)
    try:
        x = np.random.default_rng(0).random((1, 1024), dtype=np.float32)
        CC.timed_loop(client, "identity", x, CPP_WARMUP)
        took = CC.timed_loop(client, "identity", x, requests) / 1e3
    finally:
        client.close()
    return {f"p{q}": float(np.percentile(took, q)) for q in (50, 90, 99)}


def clients_at_mlp(server, exe: Path | None) -> dict:
    """CPU per request of each client alone at mlp with MLP_IN_FLIGHT in flight from
    one thread (no harness): the Python client (client_cost.submit_loop, in this
    process) and the C++ client (shmserve_latency --concurrency), one after the other."""
    from shmserve.client import Client

    out = {}
    client = Client(server.name, arena_bytes=16 << 20)
    try:
        x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
        CC.submit_loop(client, "mlp", x, 0.5, MLP_IN_FLIGHT)  # warm-up
        n, cpu = CC.submit_loop(client, "mlp", x, MLP_CLIENT_S, MLP_IN_FLIGHT)
        out["Python"] = {"client_us": 1e6 * cpu / n, "infer_per_s": n / MLP_CLIENT_S}
    finally:
        client.close()
    if exe is not None:
        r = cpp_latency(exe, server, False, None, extra=(
            "--model", "mlp", "--elements", "256", "--concurrency", str(MLP_IN_FLIGHT)),
            requests=MLP_CPP_REQUESTS)
        if r:
            out["C++"] = {"client_us": r["client_timed_us"], "p50": r["p50"]}
    return out


def contended_identity(args, url: str, label: str, **kw):
    """identity 4 KiB, 1 caller, with one busy process per core running throughout."""
    with BusyLoad() as busy:
        tr = run_identity(args, url, "4KiB", label, **kw)
    tr.label = f"{label} identity 4KiB, {busy.count} busy processes"
    return tr


def shmserve_repeat(args, out_log: Path) -> dict:
    server = L.bench_server(args.model_repository, out_log, None)
    res = {"identity": {}, "notes": []}
    try:
        server.start(timeout=60)
        url = f"shm://{server.name}"
        exe = build_cpp_latency()
        for size in IDENTITY:
            say(f"  shmserve identity {size} ...")
            res["identity"][size] = run_identity(args, url, size, "shmserve")
            if size != "4KiB":
                continue
            # right after the Python run, so that their ratio sees the same machine
            if exe is None:
                res["notes"].append("C++ client not measured: cmake, g++ or libmsgpack-cxx-dev missing")
                continue
            say("  Python client (plain loop) and C++ client identity 4KiB ...")
            res["python_plain"] = python_plain_latency(server)  # right before C++'s
            stats = server.client()
            sampler = C.ServerSampler(server.pid, lambda: model_row(stats, "identity"))
            res["cpp"] = {mode: cpp_latency(exe, server, mode == "zero-copy input", sampler,
                                            0 if mode.endswith(NO_SPIN) else None)
                          for mode in CPP_MODES}
        say("  shmserve identity 4KiB under contention ...")
        res["contended"] = contended_identity(args, url, "shmserve")
        say("  shmserve mlp 1/8/32 + bare onnxruntime ...")
        res["mlp"] = run_mlp(args, url, "shmserve")
        res["ceiling"] = {}
        for lv in res["mlp"].levels:
            hist = (lv.server_stats or {}).get("batch_requests") or {}
            if hist:
                res["ceiling"][int(lv.value)] = ort_ceiling(
                    args.model_repository / "mlp" / "1" / "model.onnx", hist)
        say(f"  clients alone at mlp, {MLP_IN_FLIGHT} in flight ...")
        res["clients_mlp"] = clients_at_mlp(server, exe)
    finally:
        res["notes"] += L.stop_server(server)
    return res


def triton_repeat(args) -> dict:
    res = {"identity": {}, "notes": []}
    if L.port_open(L.TRITON_HTTP_PORT):
        res["notes"].append("port 18000 already in use: Triton skipped")
        return res
    sh = ["bash", str(L.PEERS / "triton.sh")]
    try:
        r = subprocess.run([*sh, "start"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            res["notes"].append(f"triton.sh start failed: {r.stderr[-300:]}")
            return res
        pid = int((L.PEERS_WORK / "triton.pid").read_text())
        for size in IDENTITY:
            for proto in ("grpc+shm", "grpc"):
                say(f"  Triton identity {size} {proto} ...")
                res["identity"][f"{size}/{proto}"] = run_identity(
                    args, f"{proto}://{TRITON_GRPC}", size, f"Triton {proto}", server_pid=pid)
        say("  Triton identity 4KiB grpc+shm under contention ...")
        res["contended"] = contended_identity(args, f"grpc+shm://{TRITON_GRPC}", "Triton grpc+shm",
                                              server_pid=pid)
        say("  Triton mlp 1/8/32 ...")
        res["mlp"] = run_mlp(args, f"grpc://{TRITON_GRPC}", "Triton grpc", server_pid=pid)
    finally:
        subprocess.run([*sh, "stop"], capture_output=True, text=True, timeout=60)
    return res


# ----------------------------------------------------------------------------- report
def med(values):
    v = [x for x in values if x is not None and np.isfinite(x)]
    return float(np.median(v)) if v else None


def f(v, nd=1):
    return "-" if v is None else f"{v:,.{nd}f}"


def lvl(tr, value=None):
    if tr is None or not tr.levels:
        return None
    if value is None:
        return tr.levels[0]
    return next((x for x in tr.levels if int(x.value) == value), None)


def cpu_of(lvs) -> dict:
    """Medians over repeats of the CPU per request (us) of one scenario's levels:
    client, server by role, model, server less model, server total."""
    lvs = [x for x in lvs if x is not None]
    roles: dict[str, list] = {}
    for x in lvs:
        for r, v in (x.server_cpu_us_by_role or {}).items():
            roles.setdefault(r, []).append(v)
    return {"client": med([x.client_cpu_us_per_request for x in lvs]),
            "roles": {r: med(v) for r, v in roles.items()},
            "model": med([x.model_us_per_request for x in lvs]),
            "overhead": med([x.server_overhead_us_per_request for x in lvs]),
            "total": med([x.server_cpu_us_per_request for x in lvs])}


def cpp_cpu_of(runs: list[dict]) -> dict:
    """cpu_of() for the C++ client's runs (cpp_latency's dicts)."""
    srv = [r["server"] for r in runs if r.get("server")]
    roles: dict[str, list] = {}
    for c in srv:
        for r, v in c["us_per_request"].items():
            roles.setdefault(r, []).append(v)
    return {"client": med([r.get("client_us") for r in runs]),
            "roles": {r: med(v) for r, v in roles.items()},
            "model": med([c["model_us"] for c in srv]),
            "overhead": med([c["overhead_us"] for c in srv]),
            "total": med([c["total_us"] for c in srv])}


def growth(reps, quiet, contended) -> dict | None:
    """Quiet and contended p50/p99 (medians over repeats) and their growth factor
    contended / quiet, taken within each repeat, then the median."""
    pairs = [(lvl(quiet(r)), lvl(contended(r))) for r in reps]
    pairs = [(q, c) for q, c in pairs if q and c and q.summary["n"] and c.summary["n"]]
    if not pairs:
        return None
    out = {"repeats": len(pairs), "stable": sum(bool(c.stable) for _, c in pairs),
           "machine": med([c.machine_busy_pct for _, c in pairs])}
    for k in ("p50", "p99"):
        out[f"quiet_{k}"] = med([q.summary["latency_us"][k] for q, _ in pairs])
        out[f"contended_{k}"] = med([c.summary["latency_us"][k] for _, c in pairs])
        out[f"growth_{k}"] = med([c.summary["latency_us"][k] / q.summary["latency_us"][k]
                                  for q, c in pairs])
    return out


def summarize(reps: list[dict]) -> dict:
    """Medians over repeats of every figure the report shows, ratios within repeats."""
    out = {"identity": {}, "mlp": {}, "stages": {}, "cpu": {}, "contended": {}}
    for size in IDENTITY:
        rows = {}
        for who, get in [("shmserve", lambda r: r["shm"]["identity"].get(size)),
                         ("Triton grpc+shm", lambda r: r["triton"]["identity"].get(f"{size}/grpc+shm")),
                         ("Triton grpc", lambda r: r["triton"]["identity"].get(f"{size}/grpc"))]:
            lvs = [lvl(get(r)) for r in reps]
            lvs = [x for x in lvs if x is not None]
            if not lvs:
                continue
            rows[who] = {k: med([x.summary["latency_us"][k] for x in lvs])
                         for k in ("p50", "p90", "p99", "p99.9")}
            rows[who]["throughput"] = med([x.summary["throughput"] for x in lvs])
            rows[who]["errors"] = sum(x.summary["errors"] for x in lvs)
            rows[who]["p50_range"] = (min(x.summary["latency_us"]["p50"] for x in lvs),
                                      max(x.summary["latency_us"]["p50"] for x in lvs))
            rows[who]["repeats"] = len(lvs)
            out["cpu"][f"{who} identity {size}" + (" (Python client)" if who == "shmserve" else "")] = \
                cpu_of(lvs)
        ratios = []
        for r in reps:
            a, b = lvl(r["shm"]["identity"].get(size)), lvl(r["triton"]["identity"].get(f"{size}/grpc+shm"))
            if a and b:
                ratios.append(b.summary["latency_us"]["p50"] / a.summary["latency_us"]["p50"])
        out["identity"][size] = {"rows": rows, "triton_over_shmserve_p50": med(ratios)}
        stage_rows = {}
        for r in reps:
            x = lvl(r["shm"]["identity"].get(size))
            for b in (x.breakdown if x else []):
                stage_rows.setdefault(b["stage"], []).append(b)
        out["stages"][size] = {s: {k: med([b[k] for b in bs]) for k in ("p50", "p90", "p99")}
                               for s, bs in stage_rows.items()}
    out["cpp"] = {}
    for mode in CPP_MODES:
        runs = [r["shm"].get("cpp", {}).get(mode) for r in reps]
        runs = [x for x in runs if x]
        if runs:
            out["cpp"][mode] = {k: med([x[k] for x in runs]) for k in ("p50", "p90", "p99")}
            out["cpp"][mode]["client_timed"] = med([x.get("client_timed_us") for x in runs])
            out["cpu"][f"shmserve identity 4KiB (C++ client, {mode})"] = cpp_cpu_of(runs)
    # Python p50 / C++ p50 (copied input) within each repeat: the plain loops, run back
    # to back (the target), and the harness's Python row (its bookkeeping between calls)
    ratios, harness_ratios, plain = [], [], []
    for r in reps:
        py, cc = lvl(r["shm"]["identity"].get("4KiB")), r["shm"].get("cpp", {}).get("copied input")
        pp = r["shm"].get("python_plain")
        if pp:
            plain.append(pp)
        if pp and cc and cc["p50"]:
            ratios.append(pp["p50"] / cc["p50"])
        if py and cc and cc["p50"]:
            harness_ratios.append(py.summary["latency_us"]["p50"] / cc["p50"])
    out["python_over_cpp_p50"] = med(ratios)
    out["harness_python_over_cpp_p50"] = med(harness_ratios)
    out["python_plain"] = ({k: med([p[k] for p in plain]) for k in ("p50", "p90", "p99")}
                           if plain else None)
    out["clients_mlp"] = {who: {k: med([r["shm"].get("clients_mlp", {}).get(who, {}).get(k)
                                        for r in reps])
                                for k in ("client_us", "infer_per_s", "p50")}
                          for who in CLIENT_TARGETS}
    for callers in MLP_CALLERS:
        row, shm_ceil, shm_tri = {}, [], []
        shm = [lvl(r["shm"].get("mlp"), callers) for r in reps]
        tri = [lvl(r["triton"].get("mlp"), callers) for r in reps]
        ceil = [r["shm"].get("ceiling", {}).get(callers, {}).get("throughput") for r in reps]
        for a, b, c in zip(shm, tri, ceil):
            if a and c:
                shm_ceil.append(a.summary["throughput"] / c)
            if a and b and b.summary["throughput"]:
                shm_tri.append(a.summary["throughput"] / b.summary["throughput"])
        for who, lvs in (("shmserve", shm), ("Triton grpc", tri)):
            lvs = [x for x in lvs if x is not None]
            if lvs:
                out["cpu"][f"{who} mlp, {callers} caller(s)"] = cpu_of(lvs)
                row[who] = {"throughput": med([x.summary["throughput"] for x in lvs]),
                            "p50": med([x.summary["latency_us"]["p50"] for x in lvs]),
                            "p99": med([x.summary["latency_us"]["p99"] for x in lvs]),
                            "errors": sum(x.summary["errors"] for x in lvs),
                            "client_cpu": med([x.client_cpu_pct for x in lvs]),
                            "server_cpu": med([x.server_cpu_pct for x in lvs]),
                            "server_us": med([x.server_cpu_us_per_request for x in lvs]),
                            "machine": med([x.machine_busy_pct for x in lvs]),
                            "stable": sum(bool(x.stable) for x in lvs)}
        row["ceiling"] = med(ceil)
        row["mean_batch"] = med([r["shm"].get("ceiling", {}).get(callers, {}).get("mean_batch")
                                 for r in reps])
        row["shm_over_ceiling"] = med(shm_ceil)
        row["shm_over_triton"] = med(shm_tri)
        out["mlp"][callers] = row
    out["contended"] = {
        "shmserve": growth(reps, lambda r: r["shm"]["identity"].get("4KiB"),
                           lambda r: r["shm"].get("contended")),
        "Triton grpc+shm": growth(reps, lambda r: r["triton"]["identity"].get("4KiB/grpc+shm"),
                                  lambda r: r["triton"].get("contended"))}
    return out


BUSY_WARNING_PCT = 50.0  # of one core, with nothing of the suite running


def disturbed(res: dict) -> list[str]:
    """A warning at the top of the report when other tenants kept the CPUs busy before
    or after the run: its figures then say little against a quiet run's."""
    busy = [res[k]["busy_pct_of_one_core"] for k in ("load_before", "load_after")]
    if max(busy) < BUSY_WARNING_PCT:
        return []
    return [f"**Disturbed run**: other processes kept the CPUs busy ({busy[0]:.0f} % of one core "
            f"before the run, {busy[1]:.0f} % after, with nothing of the suite running). Absolute "
            "figures are not comparable with a quiet run's; ratios within this run are the "
            "figures to read.", ""]


def render(res: dict, s: dict) -> str:
    m = res["machine"]
    o = ["# shmserve benchmark results", "",
         f"Generated by `bench/run_all.py` on {res['started_utc']} in {res['wall_s']:.0f} s "
         f"({res['repeats']} repeat(s); medians over repeats, ratios taken within each repeat "
         "and then the median). Regenerate:", "", "```", res["command"], "```", "",
         *disturbed(res),
         "## Machine", "",
         f"- {m['cpus']} CPUs ({m['usable_cpus']} usable), {m['cpu_model']}, kernel {m['kernel']}, "
         f"Python {m['python']}, numpy {m['numpy']}; shmserve {res['commit']}",
         f"- load before: {res['load_before']['loadavg']} (busy {res['load_before']['busy_pct_of_one_core']} % "
         f"of one core, steal {res['load_before']['steal_pct_of_one_core']} %); after: "
         f"{res['load_after']['loadavg']} (busy {res['load_after']['busy_pct_of_one_core']} %)",
         "- client, server and Triton share these CPUs (no pinning). The machine is shared with "
         "other sessions: numbers move between runs; ratios within a run are the robust figures.",
         f"- harness: `shmserve_bench` (the library behind `shmserve bench`); windows of "
         f"{res['args']['window_ms']} ms after {res['args']['warmup']} s warm-up, until 3 windows "
         f"agree within 10 % or {res['args']['max_trials']} windows; figures over the last 3 "
         "windows. Latency is the client's call to return.", "",
         "## Round trip, identity, 1 caller (us)", ""]
    for size, d in s["identity"].items():
        o.append(f"### {size}")
        o.append("")
        rows = []
        for who, r in d["rows"].items():
            rows.append([who, f(r["p50"]), f(r["p90"]), f(r["p99"]), f(r["p99.9"]),
                         f(r["throughput"], 0), f"{f(r['p50_range'][0])}..{f(r['p50_range'][1])}",
                         r["errors"]])
        o.append(report.markdown_table(["target", "p50", "p90", "p99", "p99.9", "infer/s",
                                        "p50 range over repeats", "errors"], rows))
        o.append("")
        shm = d["rows"].get("shmserve", {})
        for stat, limit in TARGETS[size].items():
            v = shm.get(stat)
            o.append(f"- DESIGN.md target {size} {stat} <= {limit:.0f} us: shmserve {f(v)} us, "
                     f"**{'met' if v is not None and v <= limit else 'not met'}**")
        o.append(f"- Triton gRPC + system shm p50 / shmserve p50: "
                 f"**{f(d['triton_over_shmserve_p50'], 1)}x**")
        if size == "4KiB" and d.get("triton_over_shmserve_p50") is not None:
            o.append(target_line("Triton gRPC + system shm p50 >= 25x shmserve's",
                                 d["triton_over_shmserve_p50"], ">=", 25, "x"))
        copies = res["references"].get(TWO_COPIES, {}).get("p50")
        if size == "1MiB" and copies and shm.get("p50") is not None:
            o.append(target_line("1 MiB p50 <= 1.5x two 1 MiB copies (References, same run)",
                                 shm["p50"] / copies, "<=", 1.5, "x"))
        o.append("")
    if s["cpp"]:
        py = s["identity"].get("4KiB", {}).get("rows", {}).get("shmserve", {})
        o += ["### C++ client (clients/cpp, identity 4 KiB, 1 caller, same server, us)", ""]
        rows = [["Python client, harness (above)", f(py.get("p50")), f(py.get("p90")),
                 f(py.get("p99"))]]
        pp = s.get("python_plain")
        if pp:
            rows.append(["Python client, plain loop", f(pp["p50"]), f(pp["p90"]), f(pp["p99"])])
        rows += [[f"C++ client, {mode}", f(v["p50"]), f(v["p90"]), f(v["p99"])]
                 for mode, v in s["cpp"].items()]
        o.append(report.markdown_table(["client", "p50", "p90", "p99"], rows))
        o += ["", "C++ rows: `shmserve_latency --requests 20000` (clients/cpp/examples/latency.cpp), "
              "timed from call to return in a plain loop. The plain Python row is the same "
              "loop in Python (`client.infer(...).release()`, bench/client_cost.py's "
              "`timed_loop`, 20000 requests), run right before the C++ rows in each repeat; "
              "the harness row comes from the harness, whose bookkeeping between calls "
              "(records, windows) changes what the server's waiters see between requests.", ""]
        v = s.get("python_over_cpp_p50")
        if v is not None:
            o += [target_line("identity 4 KiB p50 from Python <= 1.3x the C++ client's (plain "
                              "loops back to back, copied input; ratio within each repeat, "
                              "median)", v, "<=", 1.3, "x")]
        v = s.get("harness_python_over_cpp_p50")
        if v is not None:
            o += [f"- the harness's Python row over the C++ client's: {v:.2f}x"]
        o.append("")
    o += ["### Where the time goes (shmserve, 1 caller, median over repeats of each stage's "
          "percentile, us; stage percentiles do not add up)", ""]
    stages = [label for label, *_ in S.STAGES if any(label in s["stages"][z] for z in IDENTITY)]
    rows = [[st] + [f(s["stages"][z].get(st, {}).get(k)) for z in IDENTITY for k in ("p50", "p99")]
            for st in stages]
    o.append(report.markdown_table(["stage"] + [f"{z} {k}" for z in IDENTITY for k in ("p50", "p99")],
                                   rows))
    o += ["", "## MLP throughput (FP32 [1,256] per request, dynamic batching)", "",
          "Callers = requests in flight (closed loop; 8 and 32 from 2 client processes). "
          "Bare onnxruntime: the same model.onnx, intra_op 1, timed on the batch sizes the "
          "server formed in that level (its batch histogram), run right after it.", ""]
    rows = []
    for c, r in s["mlp"].items():
        a, b = r.get("shmserve", {}), r.get("Triton grpc", {})
        rows.append([c, f(a.get("throughput"), 0), f(a.get("p50"), 0), f(a.get("p99"), 0),
                     f(r["mean_batch"], 1), f(r["ceiling"], 0),
                     f(None if r["shm_over_ceiling"] is None else 100 * r["shm_over_ceiling"], 0),
                     f(b.get("throughput"), 0), f(b.get("p50"), 0), f(b.get("p99"), 0),
                     f(r["shm_over_triton"], 2),
                     f"{f(a.get('client_cpu'), 0)} / {f(b.get('client_cpu'), 0)}",
                     f"{f(a.get('server_us'), 0)} / {f(b.get('server_us'), 0)}",
                     f"{f(a.get('machine'), 0)} / {f(b.get('machine'), 0)}",
                     f"{a.get('errors', '-')} / {b.get('errors', '-')}"])
    o.append(report.markdown_table(
        ["callers", "shmserve infer/s", "p50 us", "p99 us", "mean batch", "bare ORT infer/s",
         "shmserve % of ORT", "Triton infer/s", "Triton p50 us", "Triton p99 us",
         "shmserve / Triton", "client CPU % (shm / Triton)", "server CPU us/req (shm / Triton)",
         "machine busy % (shm / Triton)", "errors (shm / Triton)"], rows))
    r32 = s["mlp"].get(32, {})
    o += ["", "Machine busy % is all CPUs (200 % = both cores); well above client + server "
          "CPU means other tenants took CPU during that level.", ""]
    o += [f"- DESIGN.md target, 32 callers: >= 3x Triton: **{f(r32.get('shm_over_triton'), 2)}x** "
          f"({'met' if (r32.get('shm_over_triton') or 0) >= 3 else 'not met'}); >= 90 % of bare "
          f"onnxruntime at the same batch sizes: **{f(100 * r32['shm_over_ceiling'] if r32.get('shm_over_ceiling') else None, 0)} %** "
          f"({'met' if (r32.get('shm_over_ceiling') or 0) >= 0.9 else 'not met'})"]
    if r32.get("shm_over_triton") is not None:
        o.append(target_line("32 callers >= 5x Triton", r32["shm_over_triton"], ">=", 5, "x"))
    if r32.get("shm_over_ceiling") is not None:
        o.append(target_line("32 callers >= 60 % of bare onnxruntime",
                             100 * r32["shm_over_ceiling"], ">=", 60, " %"))
    o.append("")
    o += cpu_section(s) + contended_section(res, s) + metrics_section(res)
    o += ["## References (same run, us)", ""]
    rows = [[k, f(v["p50"]), f(v["p99"])] for k, v in res["references"].items()]
    o.append(report.markdown_table(["what", "p50", "p99"], rows))
    o += ["", "## Plots", ""]
    for p in res["plots"]:
        o.append(f"![{Path(p).stem}](plots/{Path(p).name})")
    o += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]] + [
        f"- raw figures of every repeat: {res['json']} (not committed)", ""]
    return "\n".join(o)


def target_line(what: str, value: float, op: str, bar: float, unit: str) -> str:
    """One of issue 9's bars, judged on this run's figure (op: ">=", "<=" or "<")."""
    met = {">=": value >= bar, "<=": value <= bar, "<": value < bar}[op]
    return f"- target (issue 9), {what}: {f(value, 2)}{unit}, **{'met' if met else 'not met'}**"


def cpu_section(s: dict) -> list[str]:
    o = ["## CPU per request (us, median over repeats)", "",
         "CPU time (user + system, from /proc) used during the measured windows, divided by "
         "the requests answered in them. Server: the server's process tree by role: "
         "coordinator (control socket, intake, metrics), batcher "
         "(`-m shmserve.server.batcher`), workers (`-m shmserve.server.worker`, one per model "
         "instance, the model included); *model* is the model's execution time from the "
         "server's statistics (`batch_stats[].compute_infer.ns`: wall time of each execution, summed over "
         "executions, spread over the requests), and *server less model* is the server total "
         "minus it: the serving overhead. Spin-waiting (the batcher's, the workers' and the "
         "client's `spin_us`) is CPU and is counted. Client: the harness's client processes "
         "(the Python client plus the harness's own bookkeeping, a few us), or the C++ "
         "client's rusage (`shmserve_latency`, "
         f"{CPP_REQUESTS} + {CPP_WARMUP} warm-up requests, start-up included). Triton: its "
         "whole process tree (tritonserver and the Python backend stubs, which run the "
         "model), as one figure.", ""]
    rows = []
    keys = sorted(s["cpu"], key=lambda k: (not k.startswith("shmserve"), list(s["cpu"]).index(k)))
    for k in keys:
        c = s["cpu"][k]
        roles = c["roles"]
        if "server" in roles:  # a KServe server: one figure
            rows.append([k, f(c["client"]), "-", "-", "-", "-", "-", f(c["total"])])
            continue
        rows.append([k, f(c["client"]), *[f(roles.get(r)) for r in C.ROLES], f(c["model"]),
                     f"**{f(c['overhead'])}**", f(c["total"])])
    o.append(report.markdown_table(["scenario", "client", "coordinator", "batcher", "workers",
                                    "model", "server less model", "server total"], rows))
    o.append("")
    v = s["cpu"].get("shmserve mlp, 32 caller(s)", {}).get("overhead")
    if v is not None:
        o += [target_line("server CPU per request less the model, MLP 32 callers <= 10 us", v,
                          "<=", 10, " us"), ""]
    timed = {mode: v.get("client_timed") for mode, v in s["cpp"].items()}
    if any(v is not None for v in timed.values()):
        o += ["C++ client CPU per timed request (its own getrusage around the timed loop, "
              "start-up and warm-up left out): " + ", ".join(
                  f"{mode} {f(v, 2)} us" for mode, v in timed.items() if v is not None) + ".", ""]
    cm = s.get("clients_mlp", {})
    if any(v.get("client_us") is not None for v in cm.values()):
        o += [f"Each client alone at mlp with {MLP_IN_FLIGHT} requests in flight from one "
              "thread, no harness (Python: bench/client_cost.py's `submit` loop, "
              f"{MLP_CLIENT_S:.0f} s; C++: `shmserve_latency --model mlp --concurrency "
              f"{MLP_IN_FLIGHT}`, {MLP_CPP_REQUESTS} timed requests), its own CPU per request:", ""]
        for who, limit in CLIENT_TARGETS.items():
            v = cm.get(who, {}).get("client_us")
            if v is not None:
                o.append(target_line(f"{who} client CPU per request at MLP 32 <= {limit:.0f} us",
                                     v, "<=", limit, " us"))
        o.append("")
    v = timed.get("copied input" + NO_SPIN)
    if v is not None:
        o += [f"- C++ client CPU per request at 1 caller with its spin off (the work and "
              f"its sleeps, one futex wait and wake-up per request): {f(v, 2)} us; issue 9's "
              "3 us is for MLP at 32 (above), where the answers of a batch share a wake-up.", ""]
    return o


def contended_section(res: dict, s: dict) -> list[str]:
    n = len(os.sched_getaffinity(0))
    o = ["## Under contention (identity 4 KiB, 1 caller, us)", "",
         f"The same identity 4 KiB run with {n} CPU-bound busy processes (`while True: pass`, "
         "normal priority, one per core) running for its whole length, started just before "
         "and stopped (SIGKILL, reaped) right after it; quiet = the run without them in the "
         "same repeat. Growth = contended / quiet, taken within each repeat, median over "
         "repeats.", ""]
    rows = []
    for who, g in s["contended"].items():
        if g is None:
            why = "Triton not run (see Notes)" if who.startswith("Triton") else "not measured"
            rows.append([who, why, "", "", "", "", "", ""])
            continue
        rows.append([who, f(g["quiet_p50"]), f(g["contended_p50"]), f"**{f(g['growth_p50'], 1)}x**",
                     f(g["quiet_p99"]), f(g["contended_p99"]), f"**{f(g['growth_p99'], 1)}x**",
                     f"{g['stable']}/{g['repeats']}"])
    o.append(report.markdown_table(["target", "quiet p50", "contended p50", "p50 growth",
                                    "quiet p99", "contended p99", "p99 growth",
                                    "contended runs stable"], rows))
    o.append("")
    shm = s["contended"].get("shmserve")
    triton = next((g for who, g in s["contended"].items() if who.startswith("Triton") and g), None)
    if shm and triton:
        for stat in ("p50", "p99"):
            theirs = triton["growth_" + stat]
            o.append(target_line(f"contended {stat} grows by a smaller factor than Triton's "
                                 f"({f(theirs, 2)}x)", shm["growth_" + stat], "<", theirs, "x"))
        o.append("")
    return o


def metrics_section(res: dict) -> list[str]:
    m = res.get("metrics_cost")
    o = ["## Metrics cost (identity 4 KiB, 1 caller)", ""]
    if m is None:
        return o + ["Not measured (`--metrics-pairs 0`).", ""]
    if not m.get("pairs"):
        return o + [f"Not measured: {m.get('error', 'no pair completed')}", ""]
    o += ["`bench/metrics_cost.py`: two servers, one with `--metrics-port` (GET /metrics every "
          "second while it is measured) and one without, measured in turn in pairs whose order "
          "alternates; on - off per pair, median over pairs. The scraper runs on this machine: "
          "its CPU is in the time per request, not in the server's CPU.", ""]
    return o + MC.render(m) + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window-ms", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--max-trials", type=int, default=5)
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--triton", dest="triton", action="store_true", default=None)
    p.add_argument("--no-triton", dest="triton", action="store_false")
    p.add_argument("--metrics-pairs", type=int, default=5,
                   help="A/B pairs of the metrics cost measurement (0: skip it)")
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md")
    p.add_argument("-v", "--verbose", action="store_true", help="every window")
    args = p.parse_args(argv)
    if args.triton is None:
        args.triton = L.PEERS_PY.exists()
    started = dt.datetime.now(dt.timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out = BENCH / "out"
    out.mkdir(exist_ok=True)
    plots = BENCH / "plots"
    plots.mkdir(exist_ok=True)
    t0 = time.monotonic()
    L.ensure_models(args.model_repository)
    res = {"started_utc": started.strftime("%Y-%m-%d %H:%M UTC"),
           "command": shlex.join(["python", "bench/run_all.py", *(argv or sys.argv[1:])]),
           "machine": report.machine(), "load_before": L.background_load(),
           "commit": L.machine_info()["shmserve_commit"], "notes": [],
           "args": {k: str(v) for k, v in vars(args).items()}}
    if not args.triton:
        res["notes"].append("Triton not run (no /tmp/peers-venv, or --no-triton)")
    reps, refs = [], []
    for i in range(args.repeats):
        say(f"repeat {i + 1}/{args.repeats}: references")
        ref_args = argparse.Namespace(pingpong_iters=5000, copy_iters=1000, client_spin_us=100)
        refs.append(L.references(ref_args))
        say(f"repeat {i + 1}/{args.repeats}: shmserve")
        shm = shmserve_repeat(args, out / f"run_all-{stamp}.server.log")
        tri = {"identity": {}, "notes": []}
        if args.triton:
            say(f"repeat {i + 1}/{args.repeats}: Triton")
            tri = triton_repeat(args)
        res["notes"] += [f"repeat {i + 1}: {n}" for n in shm["notes"] + tri["notes"]]
        for tr in [*shm["identity"].values(), shm.get("contended"), shm.get("mlp"),
                   *tri["identity"].values(), tri.get("contended"), tri.get("mlp")]:
            if tr is not None and tr.error:
                res["notes"].append(f"repeat {i + 1}: {tr.label}: {tr.error}")
        reps.append({"shm": shm, "triton": tri})
    if args.metrics_pairs > 0:
        say("metrics cost")
        try:
            res["metrics_cost"] = MC.measure(args.model_repository, out, args.metrics_pairs,
                                             args.window_ms, args.warmup, args.max_trials, say)
        except RuntimeError as e:
            res["metrics_cost"] = {"pairs": [], "error": str(e)}
        res["notes"] += [f"metrics cost: {n}" for n in res["metrics_cost"].get("notes", [])]
    res["references"] = {k: {"p50": med([r[k]["p50"] for r in refs]),
                             "p99": med([r[k]["p99"] for r in refs])} for k in refs[0]}
    s = summarize(reps)
    last = reps[-1]
    ident = [last["shm"]["identity"][z] for z in IDENTITY] + \
        [last["triton"]["identity"][k] for k in last["triton"]["identity"] if k.endswith("grpc+shm")]
    mlp = [t for t in (last["shm"].get("mlp"), last["triton"].get("mlp")) if t is not None]
    res["plots"] = [
        str(PL.latency_cdf(ident, plots / "identity_latency_cdf.png",
                           "identity round trip, 1 caller (last repeat)")),
        str(PL.latency_vs_throughput(mlp, plots / "mlp_latency_vs_throughput.png",
                                     "mlp: latency vs throughput at 1/8/32 callers")),
        str(PL.latency_cdf(mlp, plots / "mlp_latency_cdf.png", "mlp latency CDF (last repeat)")),
    ]
    res["load_after"] = L.background_load()
    res["wall_s"] = time.monotonic() - t0
    res["repeats"] = args.repeats
    res["json"] = f"bench/out/run_all-{stamp}.json"
    as_dict = lambda tr: tr.to_dict() if tr is not None else None
    raw = [{"shm": {"identity": {k: v.to_dict() for k, v in r["shm"]["identity"].items()},
                    "contended": as_dict(r["shm"].get("contended")),
                    "cpp": r["shm"].get("cpp"),
                    "python_plain": r["shm"].get("python_plain"),
                    "clients_mlp": r["shm"].get("clients_mlp"),
                    "mlp": as_dict(r["shm"].get("mlp")),
                    "ceiling": r["shm"].get("ceiling")},
            "triton": {"identity": {k: v.to_dict() for k, v in r["triton"]["identity"].items()},
                       "contended": as_dict(r["triton"].get("contended")),
                       "mlp": as_dict(r["triton"].get("mlp"))}}
           for r in reps]
    (ROOT / res["json"]).write_text(json.dumps({"summary": s, "run": {k: v for k, v in res.items()},
                                                "repeats": raw}, indent=1, default=report._default))
    text = render(res, s)
    args.results.write_text(text)
    print(text)
    say(f"wrote {args.results} and {res['json']} in {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
