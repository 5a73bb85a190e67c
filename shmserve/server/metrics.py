"""Prometheus metrics of the coordinator, in Triton's metric families so that
existing dashboards carry over. Served on 127.0.0.1 unless told otherwise.

Per model and version (labels `model`, `version`), counters, as Triton names them:

- nv_inference_request_success, nv_inference_request_failure: requests answered
  OK / with an error (each request counts 1 whatever its batch size);
- nv_inference_count: inferences, i.e. batch rows; nv_inference_exec_count: model
  executions (dynamic batches);
- nv_inference_queue_duration_us: cumulative time requests waited in the batcher's
  queue (from the batcher taking the request off the ring until it handed the batch
  to a worker), summed over requests. Triton adds the queue time of successful
  requests only; shmserve adds it for every request handed to a worker, also those
  whose execution then failed.

shmserve's own families: shmserve_model_ready (gauge), shmserve_execution_duration_us
(counter: cumulative model execution time summed over *executions*, i.e. batches)
and shmserve_batches_by_requests (counter: executions by number of requests batched
together).

Not provided yet, because the server does not measure them:

- nv_inference_request_duration_us (end-to-end request handling time);
- nv_inference_compute_input_duration_us, nv_inference_compute_output_duration_us
  (input gathering and output scattering are not timed apart from execution);
- nv_inference_compute_infer_duration_us: Triton sums the execution time over
  *requests* (a batch of 4 requests that ran 1 ms adds 4 ms); the server keeps it
  per execution only (compute_ns), which is not that number for batches of several
  requests, so it is exposed as shmserve_execution_duration_us instead;
- nv_inference_pending_request_count, the *_summary_us summaries, the response cache
  families (nv_cache_*), and the GPU/CPU families (nv_gpu_*, nv_cpu_*, nv_energy_*).
"""
from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

log = logging.getLogger("shmserve.metrics")

# Triton's exposition (prometheus-cpp, text format 0.0.4) names a counter family and
# its samples the same, without `_total`:
#     # TYPE nv_inference_request_success counter
#     nv_inference_request_success{model="simple",version="1"} 12
# prometheus_client cannot write that: its text writer (generate_latest) always calls
# a counter family `<name>_total` in the HELP/TYPE lines (so samples named `<name>`
# belong to no family: the bug of issue 13), and its OpenMetrics writer requires
# samples named `<name>_total`. CounterMetricFamily would expose
# `nv_inference_request_success_total`, which Triton dashboards do not query, and an
# untyped family would lose the counter type. So the families are prometheus_client's
# own data model (Metric of type "counter" with samples named as the family,
# GaugeMetricFamily, a CollectorRegistry, floatToGoString for values) and
# `exposition()` below writes them in text format 0.0.4 as Triton does, whatever the
# scraper's Accept header (Triton serves no OpenMetrics either).
# prometheus_client.parser reads it back as a counter family per name whose samples
# it calls `<name>_total` (its internal OpenMetrics naming).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _counter(name: str, text: str) -> Metric:
    """A counter family whose samples keep Triton's exact names (see above)."""
    return Metric(name, text, "counter")


# Triton family -> (statistics field, divisor to Triton's unit, help)
_COUNTERS = {
    "nv_inference_request_success": (
        "request_success", 1, "Number of successful inference requests, all batch sizes"),
    "nv_inference_request_failure": (
        "request_failure", 1, "Number of failed inference requests, all batch sizes"),
    "nv_inference_count": (
        "inference_count", 1, "Number of inferences performed (does not include cached requests)"),
    "nv_inference_exec_count": (
        "execution_count", 1,
        "Number of model executions performed (does not include cached requests)"),
    "nv_inference_queue_duration_us": (
        "queue_ns", 1000, "Cumulative inference queuing duration in microseconds"),
    "shmserve_execution_duration_us": (
        "compute_ns", 1000,
        "Cumulative model execution duration in microseconds, summed over executions "
        "(batches), not over requests"),
}


class StatsCollector:
    """Reads the counters the batcher and workers keep in the server segment."""

    def __init__(self, stats_fn):
        self.stats_fn = stats_fn  # () -> list of per-model rows (Coordinator.stats(None))

    def collect(self):
        rows = self.stats_fn()
        labels = ["model", "version"]
        for family, (field, divisor, text) in _COUNTERS.items():
            metric = _counter(family, text)
            for row in rows:
                # integers (whole microseconds, like Triton's counters): exact at any size
                metric.add_sample(family, {"model": row["name"], "version": str(row["version"])},
                                  int(row[field]) // divisor)
            yield metric
        ready = GaugeMetricFamily("shmserve_model_ready", "1 when every instance loaded",
                                  labels=labels)
        batches = _counter("shmserve_batches_by_requests",
                           "Executions by number of requests batched together")
        for row in rows:
            key = [row["name"], str(row["version"])]
            ready.add_metric(key, float(row["state"] == "READY"))
            for n, count in sorted(row["batch_requests"].items(), key=lambda kv: int(kv[0])):
                batches.add_sample("shmserve_batches_by_requests",
                                   {"model": key[0], "version": key[1], "requests": str(n)}, count)
        yield ready
        yield batches


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _value(v) -> str:
    """Integers as written (exact, as Triton writes its counters), floats as Go does."""
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else floatToGoString(v)


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format 0.0.4, family and sample names as
    collected (no `_total` added to counters; see the comment above CONTENT_TYPE)."""
    out = []
    for metric in registry.collect():
        mtype = {"unknown": "untyped"}.get(metric.type, metric.type)
        out.append(f"# HELP {metric.name} {_escape_help(metric.documentation)}\n")
        out.append(f"# TYPE {metric.name} {mtype}\n")
        for s in metric.samples:
            labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in s.labels.items())
            out.append(f"{s.name}{{{labels}}} {_value(s.value)}\n" if labels
                       else f"{s.name} {_value(s.value)}\n")
    return "".join(out).encode("utf-8")


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the subclass serve_metrics makes

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served")
            return
        try:
            body = exposition(self.registry)
        except Exception as e:  # a scrape must not take the coordinator down
            log.warning("metrics: collecting failed: %r", e)
            self.send_error(500, "collecting metrics failed")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's name
        log.debug("metrics: %s", format % args)


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def shutdown(self) -> None:
        """Stops serving and closes the listening socket (the coordinator calls this
        alone on the way out)."""
        super().shutdown()
        self.server_close()


def serve_metrics(stats_fn, port: int, address: str = "127.0.0.1"):
    """Starts the /metrics HTTP endpoint in a daemon thread; returns (server, thread).
    server.shutdown() stops it and closes its socket."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats_fn))
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    handler = type("MetricsHandler", (_Handler,), {"registry": registry})
    server_cls = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    server = server_cls((address, port), handler)
    thread = threading.Thread(target=server.serve_forever, name="shmserve-metrics", daemon=True)
    thread.start()
    return server, thread
