"""`shmserve trace-summary FILE...`: the summary Triton's qa/common/trace_summary.py
prints, for shmserve's trace files. Triton's script keeps only traces that carry its
HTTP or GRPC front's stamps, which a shared-memory request has none of; here the
caller's own stamps (CLIENT_WRITE, CLIENT_ENQUEUE) take the front's place.
"""
from __future__ import annotations

import json
import sys

# (label, from, to, indent) in the order Triton prints them
SPANS = (("Client (avg)", "CLIENT_WRITE", "REQUEST_START", 1),
         ("Ring (avg)", "CLIENT_ENQUEUE", "REQUEST_START", 2),
         ("Handler (avg)", "REQUEST_START", "REQUEST_END", 1),
         ("Queue (avg)", "QUEUE_START", "COMPUTE_START", 2),
         ("Compute (avg)", "COMPUTE_START", "COMPUTE_END", 2),
         ("Input (avg)", "COMPUTE_START", "COMPUTE_INPUT_END", 3),
         ("Infer (avg)", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", 3),
         ("Output (avg)", "COMPUTE_OUTPUT_START", "COMPUTE_END", 3),
         ("Answer (avg)", "COMPUTE_END", "REQUEST_END", 2))


def merge(objects: list) -> dict[int, dict]:
    """The objects of a trace file grouped by id, as Triton's script groups them
    (also Triton's older files, one object per trace)."""
    traces: dict[int, dict] = {}
    for obj in objects:
        if not isinstance(obj, dict) or "id" not in obj:
            continue
        t = traces.setdefault(obj["id"], {"timestamps": {}})
        t["timestamps"].update({ts["name"]: ts["ns"] for ts in obj.get("timestamps", ())})
        t.update({k: v for k, v in obj.items() if k not in ("id", "timestamps")})
    return traces


def summarize(objects: list) -> str:
    """Per model version: the trace count and the mean of each span, in microseconds."""
    groups: dict[tuple, list[dict]] = {}
    for t in merge(objects).values():
        if "REQUEST_START" in t["timestamps"] and "REQUEST_END" in t["timestamps"]:
            groups.setdefault((t.get("model_name"), t.get("model_version")), []).append(
                t["timestamps"])
    out = []
    for (model, version), traces in groups.items():
        out.append(f"Summary for {model} ({version}): trace count = {len(traces)}")
        for label, start, end, indent in SPANS:
            took = [ts[end] - ts[start] for ts in traces if start in ts and end in ts]
            if took:
                out.append("\t" * indent + f"{label}: {sum(took) / len(took) / 1000:.3f}us")
    return "\n".join(out)


def main(paths: list[str]) -> int:
    for path in paths:
        try:
            with open(path) as f:
                objects = json.load(f)
        except (OSError, ValueError) as e:  # a file still being written has no "]" yet
            print(f"shmserve trace-summary: {path}: {e}", file=sys.stderr)
            return 1
        print(f"File: {path}")
        print(summarize(objects))
    return 0
