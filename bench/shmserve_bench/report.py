"""Output: a text table, perf_analyzer-style CSV, JSON."""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import platform
import sys

import numpy as np

from . import cost as C
from . import stats as S

PCTS = [S.pkey(q) for q in S.PERCENTILES]


def _f(v, nd=1) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    return f"{v:,.{nd}f}"


def level_name(lv) -> str:
    return f"{lv.value:g}" if lv.mode == "concurrency" else f"{lv.value:g}/s"


def table(results, breakdown: bool = True) -> str:
    """The run as text: one table of levels per target, then the latency breakdown."""
    out = []
    for tr in results:
        out.append(f"== {tr.label}: model '{tr.model}'" + (f"  [{tr.error}]" if tr.error else ""))
        if not tr.levels:
            continue
        mode = tr.levels[0].mode
        head = ["concurrency" if mode == "concurrency" else "rate", "infer/s",
                *[f"{p} us" for p in PCTS], "mean us", "errors", "stable", "client CPU%",
                "client us/req", "server CPU%", "srv us/req", "less model"]
        rows = []
        for lv in tr.levels:
            s = lv.summary
            rows.append([level_name(lv), _f(s["throughput"], 0),
                         *[_f(s["latency_us"][p]) for p in PCTS], _f(s["latency_us"]["mean"]),
                         str(s["errors"]), "yes" if lv.stable else "no",
                         _f(lv.client_cpu_pct, 0), _f(lv.client_cpu_us_per_request),
                         _f(lv.server_cpu_pct, 0), _f(lv.server_cpu_us_per_request),
                         _f(lv.server_overhead_us_per_request)])
        out.append(_grid(head, rows))
        for lv in tr.levels:
            if lv.note:
                out.append(f"  note ({level_name(lv)}): {lv.note}")
            if lv.errors_total:
                errs = "; ".join(f"{n} x {m}" for m, n in sorted(lv.errors_total.items(),
                                                                  key=lambda kv: -kv[1])[:5])
                out.append(f"  errors ({level_name(lv)}, whole level incl. warm-up): {errs}")
            if lv.server_cpu_us_by_role:
                out.append(f"  server CPU per request ({level_name(lv)}): {roles_text(lv)}")
            if lv.send_lag_us:
                out.append(f"  send lag ({level_name(lv)}): p50 {_f(lv.send_lag_us['p50'])} us, "
                           f"p99 {_f(lv.send_lag_us['p99'])} us (client behind schedule if large)")
            if lv.server_stats and lv.server_stats.get("batch_requests"):
                hist = " ".join(f"{n}:{c}" for n, c in lv.server_stats["batch_requests"].items())
                out.append(f"  server batches ({level_name(lv)}), size:count: {hist}")
        if breakdown:
            for lv in tr.levels:
                if lv.breakdown:
                    out.append(f"  where the time goes, {level_name(lv)} (us; percentiles of each "
                               "stage, they do not add up):")
                    rows = [[b["stage"], _f(b["p50"]), _f(b["p90"]), _f(b["p99"]), _f(b["mean"])]
                            for b in lv.breakdown]
                    out.append(_grid(["stage", "p50", "p90", "p99", "mean"], rows, indent="    "))
        out.append("")
    return "\n".join(out)


def roles_text(lv) -> str:
    """'coordinator 9.1 us, batcher 6.0 us, workers 14.2 us (model 3.5 us): 25.8 us
    less the model' from a level's server CPU by role."""
    parts = ", ".join(f"{r} {_f(v)} us" for r, v in lv.server_cpu_us_by_role.items())
    if lv.model_us_per_request is None:
        return parts
    return (f"{parts} (model {_f(lv.model_us_per_request)} us): "
            f"{_f(lv.server_overhead_us_per_request)} us less the model")


def _grid(head, rows, indent="") -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: indent + "  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                                        for i, (x, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), indent + "  ".join("-" * w for w in widths)] +
                     [line(r) for r in rows])


def markdown_table(head, rows) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(str(x) for x in r) + " |" for r in rows])


CSV_HEAD_TAIL = ["Errors", "Stable", "Client CPU%", "Client us/request", "Server CPU%",
                 "Server us/request", "Model us/request", "Server less model us/request",
                 *[f"Server {r} us/request" for r in C.ROLES]]


def write_csv(results, path_or_file) -> None:
    """perf_analyzer's leading columns (Concurrency or Request Rate, Inferences/Second,
    percentiles and average latency in usec), then errors, stability, CPU, the
    median of each breakdown stage, and the target (one row per target and level)."""
    stages = [label for label, *_ in S.STAGES]
    head = ["Target", "Model", "Concurrency", "Request Rate", "Inferences/Second",
            *[f"{p} latency" for p in PCTS], "Avg latency", *CSV_HEAD_TAIL,
            *[f"{s} p50" for s in stages]]
    own = isinstance(path_or_file, (str, os.PathLike))
    f = open(path_or_file, "w", newline="") if own else path_or_file
    try:
        w = csv.writer(f)
        w.writerow(head)
        for tr in results:
            for lv in tr.levels:
                s = lv.summary
                bd = {b["stage"]: b["p50"] for b in lv.breakdown}
                num = lambda v, nd=1: "" if v is None or (isinstance(v, float) and np.isnan(v)) \
                    else f"{v:.{nd}f}"
                w.writerow([tr.label, tr.model,
                            int(lv.value) if lv.mode == "concurrency" else "",
                            lv.value if lv.mode == "rate" else "",
                            num(s["throughput"], 2), *[num(s["latency_us"][p]) for p in PCTS],
                            num(s["latency_us"]["mean"]), s["errors"], int(lv.stable),
                            num(lv.client_cpu_pct), num(lv.client_cpu_us_per_request, 2),
                            num(lv.server_cpu_pct), num(lv.server_cpu_us_per_request, 2),
                            num(lv.model_us_per_request, 2),
                            num(lv.server_overhead_us_per_request, 2),
                            *[num((lv.server_cpu_us_by_role or {}).get(r), 2) for r in C.ROLES],
                            *[num(bd.get(st)) for st in stages]])
    finally:
        if own:
            f.close()


def csv_text(results) -> str:
    buf = io.StringIO()
    write_csv(results, buf)
    return buf.getvalue()


def machine() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "kernel": platform.release(), "python": platform.python_version(),
            "numpy": np.__version__, "loadavg": load}


def to_json(results, config=None, extra=None) -> dict:
    doc = {"generated_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": " ".join(sys.argv), "machine": machine(),
           "results": [tr.to_dict() for tr in results]}
    if config is not None:
        cfg = {k: v for k, v in vars(config).items() if k != "progress"}
        doc["config"] = cfg
    if extra:
        doc.update(extra)
    return doc


def write_json(results, path, config=None, extra=None) -> None:
    with open(path, "w") as f:
        json.dump(to_json(results, config, extra), f, indent=1, default=_default)
        f.write("\n")


def _default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
