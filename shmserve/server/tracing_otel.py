"""OpenTelemetry spans of the traces (`--trace-config mode=opentelemetry`), made by
the coordinator from the same records as Triton's trace file (tracing.py), in the
spans Triton makes:

  InferRequest          the whole request: CLIENT_WRITE (or REQUEST_START when the
                        caller left no stamp) to REQUEST_END; events CLIENT_WRITE,
                        CLIENT_ENQUEUE
    <model name>        REQUEST_START to REQUEST_END; events REQUEST_START, QUEUE_START,
                        BATCHED, REQUEST_END; attributes triton.model_name,
                        triton.model_version, triton.trace_id, triton.trace_parent_id
      compute           COMPUTE_START to COMPUTE_END; events COMPUTE_START,
                        COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END

Span times are wall-clock (epoch ns, as OpenTelemetry wants): the monotonic stamps
plus the offset between the two clocks, read once at start (Triton does the same).
Spans go through a BatchSpanProcessor (Triton's bsp_* settings) to the OTLP/HTTP
exporter at `url` when opentelemetry-exporter-otlp-proto-http is installed; without
it, to the SDK's ConsoleSpanExporter (the server log), with a warning saying so.
"""
from __future__ import annotations

import logging
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger("shmserve.tracing")
SERVER = trace.SpanKind.SERVER  # Triton's kind for all three


def make_exporter(url: str):
    """OTLP/HTTP to url where the exporter package is installed, else the console."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("trace mode opentelemetry: the OTLP/HTTP exporter (package "
                    "opentelemetry-exporter-otlp-proto-http) is not installed, so spans "
                    "are not sent to %s: the SDK's ConsoleSpanExporter writes them to the "
                    "server log instead", url)
        return ConsoleSpanExporter()
    return OTLPSpanExporter(endpoint=url)


class OpenTelemetrySpans:
    def __init__(self, cfg, exporter=None):
        """exporter: where spans go (default make_exporter(cfg.otel_url)); the tests
        pass the SDK's InMemorySpanExporter."""
        self.provider = TracerProvider(resource=Resource.create(cfg.otel_resource),
                                       shutdown_on_exit=False)  # close() does it
        bsp = cfg.otel_bsp
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter if exporter is not None else make_exporter(cfg.otel_url),
            max_queue_size=bsp["bsp_max_queue_size"],
            schedule_delay_millis=bsp["bsp_schedule_delay"],
            max_export_batch_size=bsp["bsp_max_export_batch_size"]))
        self.tracer = self.provider.get_tracer("shmserve")
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def add(self, trace_id: int, model: str, version: int, stamps: list) -> None:
        at = {name: ns + self.offset_ns for name, ns in stamps}
        start, end = at["REQUEST_START"], at["REQUEST_END"]
        root = self.tracer.start_span("InferRequest", kind=SERVER,
                                      start_time=at.get("CLIENT_WRITE", start))
        request = self.tracer.start_span(
            model, trace.set_span_in_context(root), kind=SERVER, start_time=start,
            attributes={"triton.model_name": model, "triton.model_version": version,
                        "triton.trace_id": trace_id, "triton.trace_parent_id": 0})
        compute = self.tracer.start_span("compute", trace.set_span_in_context(request),
                                         kind=SERVER, start_time=at["COMPUTE_START"])
        for name, ns in at.items():
            span = (root if name.startswith("CLIENT_") else
                    compute if name.startswith("COMPUTE_") else request)
            span.add_event(name, timestamp=ns)
        compute.end(end_time=at["COMPUTE_END"])
        request.end(end_time=end)
        root.end(end_time=end)

    def flush(self) -> None:
        """Nothing: the BatchSpanProcessor exports on its own schedule."""

    def close(self) -> None:
        self.provider.shutdown()  # exports what is left
