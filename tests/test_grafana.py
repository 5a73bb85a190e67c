"""Issue 13: docs/grafana-dashboard.json is an importable dashboard whose every query
names metrics a real server exposes: read from a scrape of a server run with summaries
on, after traffic, by prometheus_client's parser. The nv_gpu_* families need a GPU
(and nvidia-ml-py): they are allowed by name."""
from __future__ import annotations

import json
import re

import pytest
from helpers import REPO_ROOT, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import free_port, scrape, send_requests, setup_models

pytestmark = pytest.mark.timeout(120)

DASHBOARD = REPO_ROOT / "docs" / "grafana-dashboard.json"
# Exposed only where NVML finds a device (docs/operating.md); no GPU on the test machine.
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
            "nv_gpu_power_usage", "nv_gpu_power_limit"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset"}


def panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: identifiers that are not functions,
    keywords, label names of by (...) / on (...), nor inside {...}, [...] or quotes."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    stripped = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                      " ", stripped)
    if stripped.startswith("label_values("):  # a variable: label_values(metric, label)
        stripped = stripped.rsplit(",", 1)[0]
    return {m.group(1) for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", stripped)
            if not m.group(2) and m.group(1) not in PROMQL_WORDS}


def test_dashboard_is_an_importable_export():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41, dashboard["schemaVersion"]
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model"]["definition"] == "label_values(nv_inference_request_success, model)"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels(dashboard):
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + \
            p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            for open_, close in ("()", "{}", "[]"):
                assert expr.count(open_) == expr.count(close), (p["title"], expr)
            assert metric_names(expr), (p["title"], expr)
    # a few expressions read as the test reads them
    assert metric_names('sum by (model, reason) (rate(nv_inference_request_failure'
                        '{model=~"$model"}[$__rate_interval])) > 0') == \
        {"nv_inference_request_failure"}
    assert metric_names("label_values(nv_inference_request_success, model)") == \
        {"nv_inference_request_success"}


def test_every_metric_of_the_dashboard_is_exposed(server_factory):
    port = free_port()
    server = server_factory(models=("simple",), setup=setup_models, args=[
        "--metrics-port", str(port), "--metrics-interval-ms", "100",
        "--metrics-config", "summary_latencies=true"])
    client = server.client(arena_bytes=1 << 20)  # stays connected: the per-client gauges
    send_requests(client)
    _, text = wait_until(lambda: r if "nv_cpu_utilization " in (r := scrape(port))[1] else None,
                         30, "the CPU gauges")
    exposed = set()
    for fam in text_string_to_metric_families(text):
        exposed.add(fam.name)  # a counter family under its own name, as Triton's
        if fam.type != "counter":  # the parser calls counter samples <name>_total
            exposed |= {s.name for s in fam.samples}  # summaries' _count and _sum
    used = {}
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        for name in metric_names(expr):
            used.setdefault(name, expr)
    missing = {n: e for n, e in used.items() if n not in exposed and n not in GPU_ONLY}
    assert not missing, f"not in a scrape: {missing}\n--- scrape ---\n{text}"
    # the dashboard covers the families docs/operating.md promises it
    for family in ("nv_inference_request_success", "nv_inference_request_failure",
                   "nv_inference_count", "nv_inference_exec_count",
                   "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us",
                   "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us", "nv_inference_request_summary_us",
                   "nv_inference_pending_request_count", "nv_cpu_utilization",
                   "nv_cpu_memory_used_bytes", "shmserve_ring_depth",
                   "shmserve_connected_clients", "shmserve_client_slots_in_use",
                   "shmserve_wakeups", "shmserve_instance_restarts", "shmserve_model_ready"):
        assert family in used, f"no panel shows {family}"
