"""Triton's request traces (`--trace-config`), written from the timestamps the server
takes anyway: the slot's stamps (the caller's and the batcher's) and the worker's
compute times (the same ones the statistics use). Nothing is timed for a trace alone.

Who does what:
- parse_trace_config (`shmserve serve`, before anything starts): Triton's settings,
  values and defaults; an unknown setting or value stops the start, naming it.
- Sampler (each worker): traces the rate-th request it executes, then every rate-th,
  until count. A batch with no traced request costs one integer comparison; with level
  OFF a worker has no Sampler at all. A traced request's stamps go out as one short
  line on a pipe the coordinator gave it.
- TraceSink (the coordinator): reads that pipe, numbers the traces, keeps the global
  count, and writes Triton's trace file (TritonTraceFile) or OpenTelemetry spans
  (tracing_otel.py).

Why one pipe to the coordinator rather than a file per worker: Triton's trace file is
one JSON array (with log-frequency, one array per `<file>.<n>`); per-worker files are
not Triton's file, and several processes appending to one file would interleave. A
write of at most PIPE_BUF bytes to a pipe is atomic, so the lines of different workers
never mix. The pipe is non-blocking: a coordinator that falls behind costs a worker a
dropped trace (logged), never a stalled batch.

The timestamps of a trace (CLOCK_MONOTONIC ns, as Triton's steady clock):
  CLIENT_WRITE          the caller began writing the request (its slot; shmserve's)
  CLIENT_ENQUEUE        the caller pushed it on the ring (its slot; shmserve's)
  REQUEST_START         the batcher took it from the ring (server-private copy)
  QUEUE_START           the same instant: the batcher validates and queues in one step
  BATCHED               the batcher handed its batch to an instance (shmserve's)
  COMPUTE_START         the worker began gathering the batch's inputs
  COMPUTE_INPUT_END     the model's call began
  COMPUTE_OUTPUT_START  the model's call returned
  COMPUTE_END           outputs checked and copied into the callers' arenas
  REQUEST_END           the batch's answers were published
The COMPUTE_* stamps are the batch's, shared by its requests. The caller writes the
CLIENT_* stamps (and its slot holds BATCHED): each is kept only where it can be true
(CLIENT_WRITE <= CLIENT_ENQUEUE <= REQUEST_START <= BATCHED <= COMPUTE_START).
"""
from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import logging
import os
import select
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ..protocol import LAYOUT as L, Timestamp

log = logging.getLogger("shmserve.tracing")

MODES = ("triton", "opentelemetry")
GLOBAL_SETTINGS = ("level", "rate", "count", "mode")
MODE_SETTINGS = {"triton": ("file", "log-frequency"),
                 "opentelemetry": ("url", "resource", "bsp_max_queue_size",
                                   "bsp_schedule_delay", "bsp_max_export_batch_size")}
# Triton's level words (case-insensitive): OFF disables, whatever else is given.
_LEVEL_OFF = ("off", "false")
_LEVEL_TIMESTAMPS = ("timestamps", "true", "on", "min", "max")
OTEL_DEFAULT_URL = "http://localhost:4318/v1/traces"
# Triton's BatchSpanProcessor defaults, or OpenTelemetry's environment variables.
_BSP_ENV = {"bsp_max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            "bsp_schedule_delay": ("OTEL_BSP_SCHEDULE_DELAY", 5000),
            "bsp_max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)}


@dataclasses.dataclass
class TraceConfig:
    level: str = "OFF"  # OFF or TIMESTAMPS
    rate: int = 1000  # trace one request in `rate` (Triton's default)
    count: int = -1  # stop after this many traces; -1: never
    mode: str = "triton"
    file: str | None = None  # triton mode: where the JSON goes
    log_frequency: int = 0  # triton mode: a new <file>.<n> every this many traces; 0: one file
    otel_url: str = OTEL_DEFAULT_URL
    otel_resource: dict = dataclasses.field(
        default_factory=lambda: {"service.name": "triton-inference-server"})
    otel_bsp: dict = dataclasses.field(default_factory=dict)  # BatchSpanProcessor settings
    notes: list = dataclasses.field(default_factory=list)  # settings given and unused

    @property
    def enabled(self) -> bool:
        return self.level != "OFF"


def parse_trace_config(items: list[str]) -> TraceConfig:
    """--trace-config [<mode>,]<setting>=<value> (repeatable), as Triton takes it. A
    ConfigError names a setting or value it does not know, and a configuration that
    cannot trace (no file in triton mode, opentelemetry without its SDK)."""
    cfg = TraceConfig()
    given: dict[str, dict[str, tuple[str, str]]] = {m: {} for m in ("",) + MODES}
    levels = []
    for item in items:
        head, sep, value = item.partition("=")
        mode, comma, setting = head.rpartition(",")
        mode, setting, value = mode.strip().lower(), setting.strip(), value.strip()
        if not sep or not setting or not value or (comma and not mode):
            raise ConfigError(f"--trace-config {item!r}: expected <setting>=<value> or "
                              "<mode>,<setting>=<value>")
        if comma and mode not in MODES:
            raise ConfigError(f"--trace-config {item!r}: unknown trace mode {mode!r} "
                              f"(known: {', '.join(MODES)})")
        known = MODE_SETTINGS[mode] if comma else GLOBAL_SETTINGS
        if setting not in known:
            owner = [m for m, names in MODE_SETTINGS.items() if setting in names]
            hint = (f"; it is a {owner[0]} setting: --trace-config {owner[0]},{setting}=..."
                    if owner and not comma else f" (known: {', '.join(known)})")
            raise ConfigError(f"--trace-config {item!r}: unknown setting {setting!r} for "
                              f"{mode or 'the global settings'}{hint}")
        if setting == "level":
            levels.append(value)
        elif setting == "resource":
            key, eq, attr = value.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"--trace-config {item!r}: expected resource=<key>=<value>")
            cfg.otel_resource[key.strip()] = attr.strip()
        else:
            given[mode][setting] = (f"--trace-config {item}", value)
    cfg.level = _level(levels)
    g, t, o = given[""], given["triton"], given["opentelemetry"]
    if "mode" in g:
        cfg.mode = g["mode"][1].lower()
        if cfg.mode not in MODES:
            raise ConfigError(f"{g['mode'][0]}: unknown trace mode (known: {', '.join(MODES)})")
    if "rate" in g:
        cfg.rate = _int(g["rate"], 1, "a positive integer (rate=0 is Triton's way to trace "
                        "only requests that carry an OpenTelemetry context, which shmserve "
                        "callers never send)")
    if "count" in g:
        cfg.count = _int(g["count"], -1, "-1 (no limit) or a non-negative integer")
    if "file" in t:
        cfg.file = _trace_file(*t["file"])
    if "log-frequency" in t:
        cfg.log_frequency = _int(t["log-frequency"], 0, "a non-negative integer")
    if "url" in o:
        cfg.otel_url = o["url"][1]
    for key, (env, default) in _BSP_ENV.items():
        if key in o:
            cfg.otel_bsp[key] = _int(o[key], 1, "a positive integer")
        elif env in os.environ:
            cfg.otel_bsp[key] = _int((env, os.environ[env]), 1, "a positive integer")
        else:
            cfg.otel_bsp[key] = default
    if cfg.otel_bsp["bsp_max_export_batch_size"] > cfg.otel_bsp["bsp_max_queue_size"]:
        raise ConfigError("--trace-config opentelemetry,bsp_max_export_batch_size must not be "
                          "larger than bsp_max_queue_size")
    if not cfg.enabled:  # Triton's default: given settings wait for a level
        cfg.notes += [f"{label}: unused, tracing is off (level OFF; add --trace-config "
                      "level=TIMESTAMPS)" for mode in given for key, (label, _) in
                      given[mode].items() if key != "mode"]
        return cfg
    other = MODES[1 - MODES.index(cfg.mode)]
    cfg.notes += [f"{label}: unused in trace mode {cfg.mode}" for label, _ in given[other].values()]
    if cfg.mode == "triton" and cfg.file is None:
        raise ConfigError("--trace-config level=TIMESTAMPS in trace mode triton needs a file: "
                          "--trace-config triton,file=PATH")
    if cfg.mode == "opentelemetry" and importlib.util.find_spec("opentelemetry.sdk") is None:
        raise ConfigError("--trace-config mode=opentelemetry needs the opentelemetry-sdk "
                          "package (pip install opentelemetry-sdk "
                          "opentelemetry-exporter-otlp-proto-http)")
    return cfg


def _level(values: list[str]) -> str:
    """Triton's level words, case-insensitive; an explicit OFF wins, as in Triton."""
    level = "OFF"
    for value in values:
        word = value.lower()
        if word in _LEVEL_TIMESTAMPS:
            level = "TIMESTAMPS"
        elif word == "tensors":
            raise ConfigError("--trace-config level=TENSORS is not implemented: shmserve "
                              "traces timestamps only (level=TIMESTAMPS)")
        elif word not in _LEVEL_OFF:
            raise ConfigError(f"--trace-config level={value}: unknown level (known: OFF, "
                              "TIMESTAMPS)")
    return "OFF" if any(v.lower() in _LEVEL_OFF for v in values) else level


def level_word(values: list[str]) -> str:
    """A trace extension request's trace_level (Triton's words, as _level takes them);
    ValueError names a word it does not take."""
    for value in values:
        word = value.lower()
        if word == "tensors":
            raise ValueError("TENSORS is not implemented: shmserve traces timestamps only "
                             "(TIMESTAMPS)")
        if word not in _LEVEL_OFF + _LEVEL_TIMESTAMPS:
            raise ValueError(f"unknown level {value!r} (known: OFF, TIMESTAMPS)")
    if not values or any(v.lower() in _LEVEL_OFF for v in values):
        return "OFF"
    return "TIMESTAMPS"


def _int(given: tuple[str, str], least: int, what: str) -> int:
    label, value = given
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ConfigError(f"{label}: {value!r} is not {what}")
    return number


def _trace_file(label: str, value: str) -> str:
    path = Path(value).expanduser().resolve()
    if not path.parent.is_dir():
        raise ConfigError(f"{label}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"{label}: {path} is a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{label}: directory {path.parent} is not writable")
    return str(path)


# -- the worker's side ---------------------------------------------------------------

NEVER = sys.maxsize  # requests until the next trace, once count is reached
_SLOT_STAMPS = tuple(L["slot.t_ns"] + 8 * t for t in
                     (Timestamp.CLIENT_WRITE, Timestamp.ENQUEUE, Timestamp.BATCHED))


class Sampler:
    """Picks the requests a worker traces and sends their stamps to the coordinator.
    Triton's rule (the rate-th request, then every rate-th, until count) kept per
    worker: with k instances of a model a run traces within k of N/rate requests, and
    the coordinator keeps the count exact for the whole server."""

    def __init__(self, boot: dict, model_id: int):
        self.fd = boot["fd"]
        self.model_id = model_id
        self.dropped = 0
        self.apply(boot)

    def apply(self, trace: dict) -> None:
        """The trace settings (level, rate, count) as they are now (server/settings.py:
        the trace extension changes them); counting starts again."""
        self.rate = trace["rate"]
        self.left = trace["count"] if trace["level"] != "OFF" else 0
        self.until = self.rate if self.left != 0 else NEVER  # requests to the next trace

    @property
    def enabled(self) -> bool:
        return self.left != 0

    def sample(self, live: list) -> list | None:
        """The stamps of the batch's requests to trace, or None (most batches: one
        comparison). Call it before the answers go out: the slots go back to their
        callers with them."""
        n = len(live)
        if self.until > n:
            self.until -= n
            return None
        picked, i = [], self.until - 1
        while i < n and self.left != 0:
            req = live[i]
            load, at = req.arena.ops.load64, req.slot_off
            cw, enq, batched = (load(at + off) for off in _SLOT_STAMPS)
            picked.append(f"[{self.model_id},{cw},{enq},{req.taken_ns},{batched},")
            if self.left > 0:  # -1: no limit
                self.left -= 1
            i += self.rate
        self.until = i - n + 1 if self.left != 0 else NEVER
        return picked

    def send(self, picked: list, t_input: int, t_infer: int, t_output: int, done: int) -> None:
        """One line per trace, in writes of at most PIPE_BUF bytes (atomic); now is the
        batch's REQUEST_END: its answers went out."""
        tail = f"{t_input},{t_infer},{t_output},{done},{time.monotonic_ns()}]\n"
        chunk = ""
        for head in picked:
            line = head + tail
            if len(chunk) + len(line) > select.PIPE_BUF:
                self._write(chunk)
                chunk = ""
            chunk += line
        self._write(chunk)

    def _write(self, chunk: str) -> None:
        try:
            os.write(self.fd, chunk.encode())
        except BlockingIOError:  # the coordinator is behind: drop, never wait
            if not self.dropped:
                log.warning("trace pipe full: traces are dropped until the coordinator "
                            "catches up")
            self.dropped += chunk.count("\n")
        except OSError as e:  # the coordinator is gone: stop tracing
            log.warning("cannot send traces (%s): tracing stops in this worker", e)
            self.left, self.until = 0, NEVER
        else:
            if self.dropped:
                log.warning("%d trace(s) dropped while the trace pipe was full", self.dropped)
                self.dropped = 0


# -- the coordinator's side ----------------------------------------------------------

def named_timestamps(cw: int, enq: int, start: int, batched: int, c0: int, c1: int,
                     c2: int, c3: int, end: int) -> list[tuple[str, int]]:
    """A record's stamps under their trace names, in time order (module docstring)."""
    out = []
    if 0 < enq <= start:  # the caller's own stamps: kept only where they can be true
        if 0 < cw <= enq:
            out.append(("CLIENT_WRITE", cw))
        out.append(("CLIENT_ENQUEUE", enq))
    out += [("REQUEST_START", start), ("QUEUE_START", start)]
    if start <= batched <= c0:
        out.append(("BATCHED", batched))
    return out + [("COMPUTE_START", c0), ("COMPUTE_INPUT_END", c1),
                  ("COMPUTE_OUTPUT_START", c2), ("COMPUTE_END", c3), ("REQUEST_END", end)]


class TritonTraceFile:
    """Triton's trace file: one JSON array of a head object per trace ({"id",
    "model_name", "model_version"}) and one object per timestamp ({"id", "timestamps":
    [{"name", "ns"}]}). log_frequency 0: everything in `path`, opened at the first
    trace and closed with "]" at stop; N: each N traces in `path.0`, `path.1`, ...,
    the rest at stop in the next one (Triton's TraceFile::SaveTraces)."""

    def __init__(self, path: str, log_frequency: int):
        self.path, self.log_frequency = path, log_frequency
        self.file = None
        self.pending: list[str] = []
        self.index = 0
        self.failed = False

    def add(self, trace_id: int, model: str, version: int, stamps: list) -> None:
        head = json.dumps({"id": trace_id, "model_name": model, "model_version": version},
                          separators=(",", ":"))
        text = ",".join([head] + [f'{{"id":{trace_id},"timestamps":[{{"name":"{name}",'
                                  f'"ns":{ns}}}]}}' for name, ns in stamps])
        if self.failed:
            return
        try:
            if self.log_frequency:
                self.pending.append(text)
                if len(self.pending) >= self.log_frequency:
                    self.save_indexed()
            elif self.file is None:
                self.file = open(self.path, "w")
                self.file.write("[" + text)
            else:
                self.file.write("," + text)
        except OSError as e:
            self.fail(e)

    def set_log_frequency(self, n: int) -> None:
        """From now on a new file every n traces (0: one file): what is pending or open
        is finished first, as at stop."""
        self.close()
        self.file, self.log_frequency = None, n

    def save_indexed(self) -> None:
        with open(f"{self.path}.{self.index}", "w") as f:
            f.write("[" + ",".join(self.pending) + "]")
        self.index += 1
        self.pending.clear()

    def flush(self) -> None:
        if self.file is not None and not self.failed:
            try:
                self.file.flush()
            except OSError as e:
                self.fail(e)

    def fail(self, e: OSError) -> None:
        log.error("cannot write the trace file: %s; no more traces are written", e)
        self.failed = True

    def close(self) -> None:
        try:
            if self.pending and not self.failed:
                self.save_indexed()
            if self.file is not None:
                if not self.failed:
                    self.file.write("]")
                self.file.close()
        except OSError as e:
            self.fail(e)


class TraceSink:
    """The coordinator's end of the workers' trace pipe. on_readable runs in its event
    loop; close() (at shutdown, once the workers are stopped) reads what is left and
    ends the file (or flushes the spans)."""

    def __init__(self, cfg: TraceConfig, models: dict[int, tuple[str, int]], exporter=None):
        self.cfg, self.models = cfg, models
        self.traced = 0
        self.counted_from = 0  # traces written before the count last changed
        self.buffer = b""
        self.exporter = exporter
        self.out = None  # made when tracing is first on (the trace extension may turn it on)
        self.output()
        # Non-blocking both ends: the loop reads until EAGAIN; a worker never waits.
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:  # room for bursts (up to the system's pipe-max-size)
            fcntl.fcntl(self.write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass

    def output(self):
        if self.out is None and self.cfg.enabled:
            if self.cfg.mode == "triton":
                self.out = TritonTraceFile(self.cfg.file, self.cfg.log_frequency)
            else:
                from .tracing_otel import OpenTelemetrySpans

                self.out = OpenTelemetrySpans(self.cfg, self.exporter)
        return self.out

    def worker_boot(self) -> dict:
        """What a worker's boot message carries; the fd is passed to it (pass_fds)."""
        return {"fd": self.write_fd, "rate": self.cfg.rate, "count": self.cfg.count,
                "level": self.cfg.level}

    def apply(self, trace: dict) -> None:
        """The trace extension's change (server/settings.py): level, rate, count (counted
        again from now, as the workers do) and log_frequency; file and mode are fixed."""
        self.on_readable()  # what the workers sent before the change counts as before
        cfg = self.cfg
        cfg.level, cfg.rate, cfg.count = trace["level"], trace["rate"], trace["count"]
        self.counted_from = self.traced
        self.output()
        if isinstance(self.out, TritonTraceFile) and trace["log_frequency"] != cfg.log_frequency:
            self.out.set_log_frequency(trace["log_frequency"])
        cfg.log_frequency = trace["log_frequency"]

    def on_readable(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            *lines, self.buffer = (self.buffer + data).split(b"\n")
            for line in lines:
                self.record(line)
        if self.out is not None:
            self.out.flush()

    def record(self, line: bytes) -> None:
        try:
            model_id, *stamps = json.loads(line)
            name, version = self.models[model_id]  # by table index (models.py)
            stamps = named_timestamps(*stamps)
        except (ValueError, TypeError, IndexError, KeyError):
            log.warning("malformed trace record %r", line[:200])
            return
        if 0 <= self.cfg.count <= self.traced - self.counted_from:  # workers count each for itself
            return
        if self.out is None:  # sent before tracing was turned off and on again
            return
        self.traced += 1
        self.out.add(self.traced, name, version, stamps)

    def close(self) -> None:
        try:
            self.on_readable()
            if self.out is not None:
                self.out.close()
        finally:
            os.close(self.read_fd)
            os.close(self.write_fd)
        if not self.traced and not self.cfg.enabled:
            return
        log.info("traces: %d written%s", self.traced,
                 f" to {self.cfg.file}" if self.cfg.mode == "triton" else
                 " as OpenTelemetry spans")


def start_tracing(cfg: TraceConfig | None, models: dict[int, tuple[str, int]]) -> TraceSink:
    """The coordinator's sink (also while tracing is off: the trace extension may turn
    it on); logs unused settings."""
    if cfg is None:
        cfg = TraceConfig()
    for note in cfg.notes:
        log.warning("%s", note)
    if not cfg.enabled:
        return TraceSink(cfg, models)
    where = (f"file {cfg.file}" + (f" (a new file every {cfg.log_frequency} traces)"
                                   if cfg.log_frequency else "")
             if cfg.mode == "triton" else f"OpenTelemetry, {cfg.otel_url}")
    log.info("tracing: level %s, one request in %d, %s, %s", cfg.level, cfg.rate,
             "no limit" if cfg.count < 0 else f"at most {cfg.count}", where)
    return TraceSink(cfg, models)
