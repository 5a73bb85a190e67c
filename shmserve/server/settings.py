"""Settings changed while the server runs: Triton's logging extension (log_*) and
trace extension (trace_*), asked for through a front (control operations `log_settings`
and `trace_settings`), answered and applied by the coordinator, then by every process.

One place holds them: the settings page, a sealed memfd the coordinator creates and
every child maps (boot "settings": its /proc path). The page is a u64 sequence number,
a u32 length, then the settings as JSON. The coordinator is its only writer (its event
loop, one change at a time): the sequence goes odd, the JSON is written, the sequence
goes even again. A reader copies the JSON between two loads of an even, unchanged
sequence, and the JSON carries that sequence too: a copy torn by a write is retried.

Each child watches the page from a thread of its own (watch(): one load every
WATCH_INTERVAL_S; most changes are human-made) and applies what changed: every role
its log options (logs.reconfigure), a worker its trace sampling (tracing.Sampler).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

from .. import protocol as P
from ..errors import ShmServeError
from ..logs import FORMATS, LogOptions, open_log_file, parse_format

log = logging.getLogger("shmserve.settings")

PAGE_BYTES = 64 << 10  # JSON of a few paths and numbers
HEADER_BYTES = 16  # u64 sequence, u32 length, pad
WATCH_INTERVAL_S = 0.1

# Triton's logging extension: setting -> (LogOptions field, the JSON type it takes).
LOG_SETTINGS = {"log_file": ("file", str), "log_info": ("info", bool),
                "log_warning": ("warning", bool), "log_error": ("error", bool),
                "log_verbose_level": ("verbose", int), "log_format": ("format", str)}
_KIND_WORDS = {bool: "a boolean", int: "an integer", str: "a string"}


def _bad(message: str) -> ShmServeError:
    return ShmServeError(message, P.Status.INVALID_ARG)


# -- the logging extension ----------------------------------------------------------

def log_settings(opts: LogOptions) -> dict:
    """Triton's answer: every log setting (log_file "" when the log goes to stderr)."""
    return {key: ("" if getattr(opts, field) is None else getattr(opts, field))
            for key, (field, _) in LOG_SETTINGS.items()}


def update_log(opts: LogOptions, update: dict) -> LogOptions:
    """The log options after a logging extension request; an unknown setting or a
    value of the wrong type or range raises INVALID_ARG naming it. A new log_file
    must be an absolute path the server can open (it is opened here to check)."""
    changes = {}
    for key, value in update.items():
        if key not in LOG_SETTINGS:
            raise _bad(f"log setting '{key}' is unknown (one of {', '.join(LOG_SETTINGS)})")
        field, kind = LOG_SETTINGS[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise _bad(f"log setting '{key}' takes {_KIND_WORDS[kind]}, got {value!r}")
        if key == "log_verbose_level" and not 0 <= value < 1 << 32:
            raise _bad(f"log setting 'log_verbose_level' must be a non-negative integer, "
                       f"got {value}")
        if key == "log_format":
            try:
                value = parse_format(value)
            except ValueError:
                raise _bad(f"log setting 'log_format': {value!r} is not one of "
                           f"{', '.join(FORMATS)}") from None
        if key == "log_file":
            value = _log_file(value)
        changes[field] = value
    return dataclasses.replace(opts, **changes)


def _log_file(path: str) -> str | None:
    if path == "":
        return None  # back to stderr
    if not path.startswith("/"):
        raise _bad(f"log setting 'log_file': {path!r} is not an absolute path")
    try:
        os.close(open_log_file(path))
    except OSError as e:
        raise _bad(f"log setting 'log_file': cannot open {path}: {e.strerror}") from None
    return path


# -- the page -----------------------------------------------------------------------

class SettingsPage:
    """The coordinator's (create) or a child's (attach) view of the settings page."""

    def __init__(self, segment, path: str):
        self.segment, self.path = segment, path
        self.ops = segment.ops

    @classmethod
    def create(cls, settings: dict) -> SettingsPage:
        from .segments import create_sealed

        segment = create_sealed("shmserve-settings", PAGE_BYTES, what="settings page")
        page = cls(segment, f"/proc/{os.getpid()}/fd/{segment.fd}")
        page.write(settings)
        return page

    @classmethod
    def attach(cls, path: str) -> SettingsPage:
        from ..segments import Segment

        return cls(Segment.open_path(path, PAGE_BYTES), path)

    def sequence(self) -> int:
        return self.ops.load64(0)

    def write(self, settings: dict) -> None:
        """Publishes the settings (the coordinator's loop only: one writer)."""
        seq = self.sequence()
        data = json.dumps({**settings, "sequence": seq + 2}).encode()
        if len(data) > PAGE_BYTES - HEADER_BYTES:
            raise _bad(f"the settings take {len(data)} bytes, more than the settings "
                       f"page's {PAGE_BYTES - HEADER_BYTES}")
        # SYNC POINT: the odd sequence pairs with read()'s first load: a reader that
        # saw it retries; the even store after the data pairs with its second load.
        self.ops.store64(0, seq + 1)
        buf = self.segment.buffer
        buf[HEADER_BYTES:HEADER_BYTES + len(data)] = data
        buf[8:12] = len(data).to_bytes(4, "little")
        self.ops.store64(0, seq + 2)

    def read(self) -> tuple[int, dict]:
        """(sequence, settings), a consistent copy; ValueError if none is found within
        about a second (a page written by someone else than the coordinator)."""
        buf = self.segment.buffer
        for _ in range(1000):
            seq = self.sequence()
            if seq % 2 == 0:
                n = min(int.from_bytes(buf[8:12], "little"), PAGE_BYTES - HEADER_BYTES)
                data = bytes(buf[HEADER_BYTES:HEADER_BYTES + n])
                if self.sequence() == seq:
                    try:
                        settings = json.loads(data)
                    except ValueError:
                        settings = None
                    if isinstance(settings, dict) and settings.get("sequence") == seq:
                        return seq, settings
            time.sleep(0.001)
        raise ValueError(f"the settings page {self.path} holds no consistent settings")

    def close(self) -> None:
        self.segment.close()


def watch(path: str, apply) -> None:
    """A child's watcher thread: apply(settings) now and at each change of the page."""
    page = SettingsPage.attach(path)
    seen, settings = page.read()
    apply(settings)

    def loop():
        nonlocal seen
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if page.sequence() != seen:
                try:
                    seen, new = page.read()
                    apply(new)
                except Exception:  # a bad page or change must not end the watching
                    log.exception("applying changed settings failed")
                    seen = page.sequence()

    threading.Thread(target=loop, name="settings-watch", daemon=True).start()


# -- the trace extension ------------------------------------------------------------

# Triton's trace settings a request may change, and those it may only read.
TRACE_SETTINGS = ("trace_level", "trace_rate", "trace_count", "log_frequency")
TRACE_FIXED = {"trace_file": "trace file location can not be updated through network "
                             "protocol (set it with --trace-config triton,file=...)",
               "trace_mode": "trace_mode can not be updated while the server runs (set it "
                             "with --trace-config mode=...)"}


def trace_settings(trace: dict) -> dict:
    """Triton's answer (TraceSetting: each setting a list of strings)."""
    out = {"trace_level": [trace["level"]], "trace_rate": [str(trace["rate"])],
           "trace_count": [str(trace["count"])], "log_frequency": [str(trace["log_frequency"])],
           "trace_mode": [trace["mode"]]}
    if trace["file"] is not None:
        out["trace_file"] = [trace["file"]]
    return out


def update_trace(trace: dict, initial: dict, update: dict) -> dict:
    """The trace settings after a trace extension request: update maps Triton's names
    to a list of strings, a string or a number, or to None or [] (back to the value
    the server started with). INVALID_ARG names an unknown setting or a bad value."""
    from .tracing import level_word

    new = dict(trace)
    for key, value in update.items():
        if key in TRACE_FIXED:  # asking for what it is already is no change
            current = trace_settings(trace).get(key, [])
            if value not in (None, [], current, *current):
                raise _bad(TRACE_FIXED[key])
            continue
        if key not in TRACE_SETTINGS:
            raise _bad(f"trace setting '{key}' is unknown (one of "
                       f"{', '.join(TRACE_SETTINGS + tuple(TRACE_FIXED))})")
        field = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count",
                 "log_frequency": "log_frequency"}[key]
        if value is None or value == []:
            new[field] = initial[field]
            continue
        values = value if isinstance(value, list) else [value]
        if key != "trace_level" and len(values) != 1:
            raise _bad(f"trace setting '{key}' takes one value, got {value!r}")
        if key == "trace_level":
            try:
                new["level"] = level_word([str(v) for v in values])
            except ValueError as e:
                raise _bad(f"trace setting 'trace_level': {e}") from None
            continue
        least = {"rate": 1, "count": -1, "log_frequency": 0}[field]
        try:
            number = int(str(values[0]), 10)
            if number < least:
                raise ValueError
        except ValueError:
            raise _bad(f"trace setting '{key}' must be an integer of at least {least}, got "
                       f"{values[0]!r}") from None
        new[field] = number
    if new["level"] != "OFF" and new["mode"] == "triton" and new["file"] is None:
        raise _bad("trace setting 'trace_level': tracing needs a trace file, and none was "
                   "given at start (--trace-config triton,file=<path>; it cannot be set "
                   "through the network protocol)")
    return new


class RuntimeSettings:
    """The coordinator's side: the settings as they are, their page, and what it
    applies itself (its own log, its trace sink)."""

    def __init__(self, log_options: LogOptions, trace_config, trace_sink):
        self.log_options = log_options
        cfg = trace_config
        self.trace = self.initial_trace = {
            "level": cfg.level, "rate": cfg.rate, "count": cfg.count, "mode": cfg.mode,
            "file": cfg.file, "log_frequency": cfg.log_frequency}
        self.sink = trace_sink
        self.page = SettingsPage.create(self.as_dict())

    def as_dict(self) -> dict:
        return {"log": self.log_options.as_dict(), "trace": self.trace}

    def log(self, update: dict | None) -> dict:
        if update:
            from ..logs import reconfigure

            opts = update_log(self.log_options, update)
            if opts != self.log_options:
                reconfigure(opts)
                self.log_options = opts
                self.page.write(self.as_dict())
                log.info("log settings changed: %s", update)
        return log_settings(self.log_options)

    def trace_of(self, update: dict | None) -> dict:
        if update:
            trace = update_trace(self.trace, self.initial_trace, update)
            if trace != self.trace:
                self.trace = trace
                self.sink.apply(trace)
                self.page.write(self.as_dict())
                log.info("trace settings changed: %s", update)
        return trace_settings(self.trace)

    def close(self) -> None:
        self.page.close()


# -- a child's side -------------------------------------------------------------------

_appliers: list = []
_latest: dict = {}


def on_change(apply) -> None:
    """apply(settings) now, with the latest settings seen, and at each change."""
    _appliers.append(apply)
    if _latest:
        apply(_latest)


def start_watching(path: str) -> None:
    """child_setup's: every role's log options follow the page."""
    from ..logs import reconfigure

    def apply(settings):
        _latest.clear()
        _latest.update(settings)
        reconfigure(LogOptions.from_dict(settings["log"]))
        for fn in list(_appliers):
            fn(settings)

    watch(path, apply)
