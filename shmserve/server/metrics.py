"""Prometheus metrics of the coordinator, in Triton's metric families so that
existing dashboards carry over. Served on 127.0.0.1 unless told otherwise."""
from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry


def _counter(name: str, text: str) -> Metric:
    """A counter whose samples keep Triton's exact names (no `_total` suffix)."""
    return Metric(name, text, "counter")

# Triton family -> (statistics field, scale, help)
_COUNTERS = {
    "nv_inference_request_success": ("request_success", 1, "Number of successful inference requests"),
    "nv_inference_request_failure": ("request_failure", 1, "Number of failed inference requests"),
    "nv_inference_count": ("inference_count", 1, "Number of inferences performed (batch rows)"),
    "nv_inference_exec_count": ("execution_count", 1, "Number of model executions (batches)"),
    "nv_inference_queue_duration_us": ("queue_ns", 1e-3, "Cumulative time requests spent queued"),
    "nv_inference_compute_infer_duration_us": ("compute_ns", 1e-3, "Cumulative model execution time"),
}


class StatsCollector:
    """Reads the counters the batcher and workers keep in the server segment."""

    def __init__(self, stats_fn):
        self.stats_fn = stats_fn  # () -> list of per-model rows (Coordinator.stats(None))

    def collect(self):
        rows = self.stats_fn()
        labels = ["model", "version"]
        for family, (field, scale, text) in _COUNTERS.items():
            metric = _counter(family, text)
            for row in rows:
                metric.add_sample(family, {"model": row["name"], "version": str(row["version"])},
                                  row[field] * scale)
            yield metric
        ready = GaugeMetricFamily("shmserve_model_ready", "1 when every instance loaded",
                                  labels=labels)
        batches = _counter("shmserve_batches_by_requests",
                           "Executions by number of requests batched together")
        for row in rows:
            key = [row["name"], str(row["version"])]
            ready.add_metric(key, float(row["state"] == "READY"))
            for n, count in row["batch_requests"].items():
                batches.add_sample("shmserve_batches_by_requests",
                                   {"model": key[0], "version": key[1], "requests": str(n)}, count)
        yield ready
        yield batches


def serve_metrics(stats_fn, port: int, address: str = "127.0.0.1"):
    """Starts the /metrics HTTP endpoint in a daemon thread; returns (server, thread)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(StatsCollector(stats_fn))
    return start_http_server(port, addr=address, registry=registry)
