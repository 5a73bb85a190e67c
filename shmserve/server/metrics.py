"""Prometheus metrics of the coordinator, in Triton's metric families so that
existing dashboards and alerts carry over, plus shmserve's own under `shmserve_`.
Served on 127.0.0.1 unless told otherwise (docs/operating.md lists every family).

How the numbers get here without costing the hot path: the batcher and the workers
add to counters and latency histograms in the server segment (csrc/shms_stats.h: a
few relaxed atomic adds per request, no system call, no message); this endpoint's
thread asks the coordinator's event loop for a snapshot (Coordinator.server_status)
when scraped. CPU, memory and GPU gauges and the summaries' sliding window are
refreshed every --metrics-interval-ms by a thread of their own.

Per model and version (labels model, version), as Triton names them:
- counters nv_inference_request_success, nv_inference_request_failure {reason:
  REJECTED | CANCELED | BACKEND | OTHER}, nv_inference_count, nv_inference_exec_count;
- counters (counter_latencies, on by default) nv_inference_request_duration_us,
  _queue_duration_us, _compute_input_duration_us, _compute_infer_duration_us,
  _compute_output_duration_us: microseconds summed over requests;
- gauge nv_inference_pending_request_count: requests queued in the batcher;
- histogram (--metrics-config histogram_latencies=true)
  nv_inference_first_response_histogram_ms: decoupled models' time to first response;
- summaries (--metrics-config summary_latencies=true) nv_inference_request_summary_us,
  _queue_summary_us, _compute_input/_infer/_output_summary_us: quantiles
  (summary_quantiles) over the last SUMMARY_WINDOW_S seconds, read from the
  histograms (within 6 %), _count and _sum since the start.
Machine-wide (--allow-cpu-metrics): nv_cpu_utilization, nv_cpu_memory_total_bytes,
nv_cpu_memory_used_bytes; per GPU (--allow-gpu-metrics, where NVML finds one):
nv_gpu_utilization, nv_gpu_memory_total_bytes, nv_gpu_memory_used_bytes,
nv_gpu_power_usage, nv_gpu_power_limit, nv_energy_consumption.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from ..errors import ConfigError
from . import statistics
from .devices import nvml

log = logging.getLogger("shmserve.metrics")
# histogram_latencies: the buckets (ms) of nv_inference_first_response_histogram_ms
FIRST_RESPONSE_BUCKETS_MS = (100, 500, 2000, 5000)

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


SUMMARY_WINDOW_S = 60.0  # prometheus-cpp's default max_age, Triton's summaries' window
DEFAULT_QUANTILES = "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.001"
LABELS = ("model", "version")

# Triton family -> (inference_stats duration(s), help), microseconds summed over requests
_DURATIONS = {
    "nv_inference_request_duration_us": (
        ("success", "fail"), "Cumulative inference request duration in microseconds"),
    "nv_inference_queue_duration_us": (
        ("queue",), "Cumulative inference queuing duration in microseconds"),
    "nv_inference_compute_input_duration_us": (
        ("compute_input",), "Cumulative compute input duration in microseconds"),
    "nv_inference_compute_infer_duration_us": (
        ("compute_infer",), "Cumulative compute inference duration in microseconds"),
    "nv_inference_compute_output_duration_us": (
        ("compute_output",), "Cumulative inference compute output duration in microseconds"),
}
_SUMMARIES = {
    "nv_inference_request_summary_us": (("success", "fail"), "inference request duration"),
    "nv_inference_queue_summary_us": (("queue",), "inference queuing duration"),
    "nv_inference_compute_input_summary_us": (("compute_input",), "compute input duration"),
    "nv_inference_compute_infer_summary_us": (("compute_infer",), "compute inference duration"),
    "nv_inference_compute_output_summary_us": (("compute_output",), "compute output duration"),
}
_BOOL = {"true": True, "1": True, "false": False, "0": False}


def parse_metrics_config(items: list[str]) -> dict:
    """--metrics-config key=value (repeatable), as Triton takes it; a ConfigError names
    a key or value it does not know."""
    config = {"counter_latencies": True, "summary_latencies": False,
              "histogram_latencies": False, "summary_quantiles": parse_quantiles(DEFAULT_QUANTILES)}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ConfigError(f"--metrics-config {item!r}: expected key=value")
        if key == "summary_quantiles":
            config[key] = parse_quantiles(value)
        elif key in ("counter_latencies", "summary_latencies", "histogram_latencies"):
            if value.lower() not in _BOOL:
                raise ConfigError(f"--metrics-config {key}={value}: expected true or false")
            config[key] = _BOOL[value.lower()]
        else:
            raise ConfigError(f"--metrics-config: unknown setting {key!r} (known: "
                              "counter_latencies, summary_latencies, summary_quantiles, "
                              "histogram_latencies)")
    return config


def parse_quantiles(text: str) -> list[float]:
    """Triton's summary_quantiles "<quantile>:<error>,...". The error is accepted and
    not needed: quantiles are read from histograms, within their bucket width."""
    out = []
    for part in filter(None, (p.strip() for p in text.strip('"').split(","))):
        q = part.split(":", 1)[0]
        try:
            value = float(q)
        except ValueError:
            raise ConfigError(f"--metrics-config summary_quantiles: {part!r} is not "
                              "<quantile>:<error>") from None
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"--metrics-config summary_quantiles: {value} is not in [0, 1]")
        out.append(value)
    if not out:
        raise ConfigError("--metrics-config summary_quantiles: no quantile given")
    return out


def _counter(name: str, text: str) -> Metric:
    """A counter family whose samples keep Triton's exact names (see above)."""
    return Metric(name, text, "counter")


def _key(stat: dict) -> dict:
    return {"model": stat["name"], "version": str(stat["version"])}


class Sampler:
    """What Triton updates per interval: CPU and memory (psutil), GPUs (NVML, when
    the package and a device are there), and the histogram snapshots that give the
    summaries their sliding window. One thread; collect() reads its latest values."""

    def __init__(self, snapshot, config: dict, interval_ms: int):
        self.snapshot, self.config = snapshot, config
        self.interval_s = max(interval_ms, 10) / 1000.0
        self.window: collections.deque = collections.deque()  # (monotonic, {key: hists})
        self.cpu: dict = {}
        self.gpus: list[dict] = []
        self.nvml = nvml() if config.get("gpu", True) else None
        self.energy_start: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="shmserve-metrics-sampler", daemon=True)

    def run(self) -> None:
        import psutil

        psutil.cpu_percent(None)  # the first call starts the interval
        while not self.stop.wait(self.interval_s):
            try:
                self.sample(psutil)
            except Exception as e:  # a failed sample must not stop the next one
                log.debug("metrics: sampling failed: %r", e)

    def sample(self, psutil) -> None:
        if self.config.get("cpu", True):
            mem = psutil.virtual_memory()
            self.cpu = {"utilization": psutil.cpu_percent(None) / 100.0,
                        "total": mem.total, "used": mem.total - mem.available}
        if self.nvml is not None:
            self.gpus = _gpu_readings(self.nvml, self.energy_start)
        if self.config["summary_latencies"]:
            now = time.monotonic()
            status = self.snapshot(True)
            self.window.append((now, {(s["name"], s["version"]): s["shmserve"]["histograms"]
                                      for s in status["models"]}))
            while self.window and now - self.window[0][0] > SUMMARY_WINDOW_S:
                self.window.popleft()

    def window_start(self, key, kind: str):
        """The histogram of (model, version) and kind at the start of the window."""
        for _, hists in self.window:
            if key in hists:
                return statistics.dense(hists[key][kind])
        return None


class StatsCollector:
    """The families, from one coordinator snapshot per scrape."""

    def __init__(self, snapshot, sampler: Sampler):
        self.snapshot, self.sampler, self.config = snapshot, sampler, sampler.config

    def collect(self):
        status = self.snapshot(self.config["summary_latencies"] or
                               self.config["histogram_latencies"])
        models = status["models"]
        yield from self.counts(models)
        if self.config["counter_latencies"]:
            yield from self.durations(models)
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting "
                                    "execution per-model.", labels=LABELS)
        for s in models:
            pending.add_metric(list(_key(s).values()), s["shmserve"]["pending"])
        yield pending
        if self.config["summary_latencies"]:
            yield from self.summaries(models)
        if self.config["histogram_latencies"]:
            yield self.first_response(models)
        yield from self.machine()
        yield from self.own(status)

    def counts(self, models):
        success = _counter("nv_inference_request_success",
                           "Number of successful inference requests, all batch sizes")
        failure = _counter("nv_inference_request_failure",
                           "Number of failed inference requests, all batch sizes")
        count = _counter("nv_inference_count",
                         "Number of inferences performed (does not include cached requests)")
        execs = _counter("nv_inference_exec_count",
                         "Number of model executions performed (does not include cached requests)")
        for s in models:
            key = _key(s)
            success.add_sample(success.name, key, s["inference_stats"]["success"]["count"])
            for reason, n in s["shmserve"]["failures"].items():
                failure.add_sample(failure.name, {**key, "reason": reason}, n)
            count.add_sample(count.name, key, s["inference_count"])
            execs.add_sample(execs.name, key, s["execution_count"])
        yield from (success, failure, count, execs)
        if self.config.get("response_cache"):  # --cache-config: Triton's per-model families
            yield from self.cache(models)

    def cache(self, models):
        for family, kind, field, text in (
                ("nv_cache_num_hits_per_model", "cache_hit", "count", "Number of cache hits per model"),
                ("nv_cache_num_misses_per_model", "cache_miss", "count", "Number of cache misses per model"),
                ("nv_cache_hit_duration_per_model", "cache_hit", "ns",
                 "Total cache hit duration per model, in microseconds"),
                ("nv_cache_miss_duration_per_model", "cache_miss", "ns",
                 "Total cache miss (insertion) duration per model, in microseconds")):
            metric = _counter(family, text)
            for s in models:
                value = s["inference_stats"][kind][field]
                metric.add_sample(family, _key(s), value // 1000 if field == "ns" else value)
            yield metric

    def durations(self, models):
        for family, (kinds, text) in _DURATIONS.items():
            metric = _counter(family, text)
            for s in models:
                ns = sum(s["inference_stats"][k]["ns"] for k in kinds)
                metric.add_sample(family, _key(s), ns // 1000)  # whole µs, as Triton
            yield metric

    def summaries(self, models):
        qs = self.config["summary_quantiles"]
        for family, (kinds, what) in _SUMMARIES.items():
            metric = Metric(family, f"Summary of {what} in microseconds", "summary")
            for s in models:
                key, hists = _key(s), s["shmserve"]["histograms"]
                now = sum(statistics.dense(hists[k]) for k in kinds)
                starts = [self.sampler.window_start((s["name"], s["version"]), k) for k in kinds]
                window = now - sum(starts) if all(x is not None for x in starts) else now
                for q, v in zip(qs, statistics.quantiles(window, qs)):
                    metric.add_sample(family, {**key, "quantile": floatToGoString(q)},
                                      float("nan") if v is None else v / 1000.0)
                metric.add_sample(family + "_count", key,
                                  sum(s["inference_stats"][k]["count"] for k in kinds))
                metric.add_sample(family + "_sum", key,
                                  sum(s["inference_stats"][k]["ns"] for k in kinds) / 1000.0)
            yield metric

    def first_response(self, models):
        """Triton's nv_inference_first_response_histogram_ms: for decoupled models (the
        only ones that record a first response), read from the log-linear histogram of
        shms_stats.h: a bucket counts below a bound when its upper edge is (within
        the histogram's 6 %)."""
        family = "nv_inference_first_response_histogram_ms"
        metric = Metric(family, "Duration from request to first response in milliseconds",
                        "histogram")
        _, high = statistics.bucket_bounds()
        for s in models:
            first = s["shmserve"]["first_response"]
            if not first["count"]:
                continue
            key, counts = _key(s), statistics.dense(s["shmserve"]["histograms"]["first_response"])
            for le in FIRST_RESPONSE_BUCKETS_MS:
                below = int(counts[high <= le * 1e6].sum())
                metric.add_sample(family + "_bucket", {**key, "le": floatToGoString(le)}, below)
            metric.add_sample(family + "_bucket", {**key, "le": "+Inf"}, first["count"])
            metric.add_sample(family + "_count", key, first["count"])
            metric.add_sample(family + "_sum", key, first["ns"] / 1e6)
        return metric

    def machine(self):
        cpu = self.sampler.cpu
        if cpu:
            for name, field, text in (
                    ("nv_cpu_utilization", "utilization", "CPU utilization rate [0.0 - 1.0]"),
                    ("nv_cpu_memory_total_bytes", "total", "CPU total memory (RAM), in bytes"),
                    ("nv_cpu_memory_used_bytes", "used", "CPU used memory (RAM), in bytes")):
                yield GaugeMetricFamily(name, text, value=cpu[field])
        if self.sampler.gpus:
            for name, text in _GPU_FAMILIES.items():
                metric = (_counter(name, text) if name == "nv_energy_consumption"
                          else GaugeMetricFamily(name, text, labels=["gpu_uuid"]))
                for gpu in self.sampler.gpus:
                    if name in gpu:
                        metric.add_sample(name, {"gpu_uuid": gpu["uuid"]}, gpu[name])
                yield metric

    def own(self, status: dict):
        ready = GaugeMetricFamily("shmserve_model_ready", "1 when every instance loaded",
                                  labels=LABELS)
        batches = _counter("shmserve_batches_by_requests",
                           "Executions by number of requests batched together")
        restarts = _counter("shmserve_instance_restarts",
                            "Restarts of a model instance's worker process")
        executions = _counter("shmserve_instance_executions", "Batches a model instance ran")
        wakeups = _counter("shmserve_wakeups",
                           "Wake-ups of server processes: after spinning or after sleeping "
                           "(futex), by role")
        for s in status["models"]:
            key = _key(s)
            ready.add_metric(list(key.values()), float(s["shmserve"]["state"] == "READY"))
            for n, count in s["shmserve"]["batch_requests"].items():
                batches.add_sample(batches.name, {**key, "requests": str(n)}, count)
            for inst in s["shmserve"]["instances"]:
                # not "instance": Prometheus's own label for the scrape target
                labels = {**key, "model_instance": str(inst["instance"])}
                restarts.add_sample(restarts.name, labels, inst["restarts"])
                executions.add_sample(executions.name, labels, inst["executions"])
                for how, n in inst["wakeups"].items():
                    wakeups.add_sample(wakeups.name, {"role": "worker", **labels,
                                                      "how": how.lower()}, n)
        batcher = status["batcher"]
        for how, n in batcher["wakeups"].items():
            wakeups.add_sample(wakeups.name, {"role": "batcher", "model": "", "version": "",
                                              "model_instance": "", "how": how.lower()}, n)
        yield from (ready, batches, restarts, executions, wakeups)
        yield _counter_value("shmserve_batcher_restarts", "Restarts of the batcher process",
                             batcher["restarts"])
        watch = status.get("cpu_watch")  # cpu_watch.py
        if watch is not None:
            yield GaugeMetricFamily("shmserve_cpus_crowded", "1 while other work leaves no "
                                    "CPU idle, and waiters sleep at once instead of spinning",
                                    value=float(watch["crowded"]))
        if watch is not None and watch["free_cpus"] is not None:
            yield GaugeMetricFamily("shmserve_cpus_free", "CPUs other work left free in the "
                                    "last interval of the CPU watch", value=watch["free_cpus"])
        yield GaugeMetricFamily("shmserve_ring_depth", "Requests pushed on the clients' "
                                "submission rings and not yet taken by the batcher",
                                value=status["ring_depth"])
        yield GaugeMetricFamily("shmserve_connected_clients", "Clients holding a lease",
                                value=len(status["clients"]))
        slots = GaugeMetricFamily("shmserve_client_slots_in_use",
                                  "Request slots of a client not FREE", labels=["client", "pid"])
        inflight = GaugeMetricFamily("shmserve_client_bytes_in_flight",
                                     "Tensor bytes named by a client's requests in flight",
                                     labels=["client", "pid"])
        arena = GaugeMetricFamily("shmserve_client_arena_bytes", "Size of a client's arena",
                                  labels=["client", "pid"])
        for c in status["clients"]:
            labels = [str(c["client"]), str(c["pid"])]
            slots.add_metric(labels, c["slots_in_use"])
            inflight.add_metric(labels, c["bytes_in_flight"])
            arena.add_metric(labels, c["arena_bytes"])
        yield from (slots, inflight, arena)


def _counter_value(name: str, text: str, value) -> Metric:
    metric = _counter(name, text)
    metric.add_sample(name, {}, value)
    return metric


_GPU_FAMILIES = {
    "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0)",
    "nv_gpu_memory_total_bytes": "GPU total memory, in bytes",
    "nv_gpu_memory_used_bytes": "GPU used memory, in bytes",
    "nv_gpu_power_usage": "GPU power usage in watts",
    "nv_gpu_power_limit": "GPU power management limit in watts",
    "nv_energy_consumption": "GPU energy consumption in joules since the server started",
}


def _gpu_readings(nvml, energy_start: dict) -> list[dict]:
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        row = {"uuid": uuid, "nv_gpu_utilization": nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
               "nv_gpu_memory_total_bytes": mem.total, "nv_gpu_memory_used_bytes": mem.used}
        try:
            row["nv_gpu_power_usage"] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            row["nv_gpu_power_limit"] = nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0
            joules = nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
            row["nv_energy_consumption"] = joules - energy_start.setdefault(uuid, joules)
        except nvml.NVMLError:  # power readings are not on every device
            pass
        out.append(row)
    return out


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

    sampler: Sampler | None = None

    def shutdown(self) -> None:
        """Stops serving and sampling and closes the listening socket (the coordinator
        calls this alone on the way out)."""
        if self.sampler is not None:
            self.sampler.stop.set()
        super().shutdown()
        self.server_close()


def serve_metrics(snapshot, port: int, address: str = "127.0.0.1", config: dict | None = None,
                  interval_ms: int = 2000) -> "_MetricsServer":
    """Starts the /metrics endpoint and its sampler in daemon threads. snapshot(histograms)
    returns Coordinator.server_status(). The returned server's shutdown() stops both and
    closes the socket."""
    config = {**parse_metrics_config([]), **(config or {})}
    sampler = Sampler(snapshot, config, interval_ms)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, sampler))
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    handler = type("MetricsHandler", (_Handler,), {"registry": registry})
    server_cls = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    server = server_cls((address, port), handler)
    server.sampler = sampler
    sampler.thread.start()
    threading.Thread(target=server.serve_forever, name="shmserve-metrics", daemon=True).start()
    return server
