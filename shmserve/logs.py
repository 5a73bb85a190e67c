"""The server's log: one set-up for its three process roles (coordinator, batcher,
workers), with Triton's options and line formats.

    default:  I1203 15:06:14.123456 4242 coordinator/supervisor.py:61] message
    ISO8601:  2026-12-03T15:06:14Z I 4242 coordinator/supervisor.py:61] message

As Triton: severity E, W or I (verbose lines are I too), UTC time, the process id,
then where the line comes from (here the process role and the Python file) and line.
Every record is one write(2) on a descriptor opened with O_APPEND, so the processes
sharing a --log-file (or stderr) never cut into each other's lines.

The coordinator builds LogOptions from `shmserve serve`'s flags and hands them to
each child in its boot message (as_dict / from_dict); every role calls setup().
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import sys
import threading
import time

FORMATS = ("default", "ISO8601")
LEVELS = ("debug", "info", "warning", "error")  # --log-level, kept beside Triton's flags


def parse_format(text: str) -> str:
    """--log-format's value, as Triton spells it ("iso8601" is taken too)."""
    for name in FORMATS:
        if text.strip().lower() == name.lower():
            return name
    raise ValueError(f"{text!r} is not a log format (default, ISO8601)")


def parse_level(text: str) -> str:
    t = text.strip().lower()
    if t not in LEVELS:
        raise ValueError(f"{text!r} is not a log level ({', '.join(LEVELS)})")
    return t


@dataclasses.dataclass(frozen=True)
class LogOptions:
    verbose: int = 0  # --log-verbose: 0 off, >= 1 verbose (debug) lines
    info: bool = True  # --log-info, --log-warning, --log-error: each severity on or off
    warning: bool = True
    error: bool = True
    format: str = "default"  # --log-format
    file: str | None = None  # --log-file, an absolute path; None: stderr

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"log format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.verbose < 0:
            raise ValueError(f"log verbose level {self.verbose} is negative")

    @classmethod
    def with_level(cls, level: str, **flags) -> LogOptions:
        """Triton's flags narrowed or widened by --log-level: debug turns verbose lines
        on (as --log-verbose 1), warning turns info lines off (as --log-info=false),
        error turns warnings off too. A severity is shown only if neither turns it off."""
        level = parse_level(level)
        opts = cls(**flags)
        return dataclasses.replace(
            opts, verbose=max(opts.verbose, int(level == "debug")),
            info=opts.info and level in ("debug", "info"),
            warning=opts.warning and level != "error")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LogOptions:
        return cls(**d)

    def shows(self, levelno: int) -> bool:
        if levelno >= logging.ERROR:
            return self.error
        if levelno >= logging.WARNING:
            return self.warning
        if levelno >= logging.INFO:
            return self.info
        return self.info and self.verbose >= 1  # Triton: verbose lines are info lines


class TritonFormatter(logging.Formatter):
    """One record as one Triton-style line (or several, for a traceback)."""

    def __init__(self, role: str, fmt: str = "default"):
        super().__init__()
        self.role, self.fmt = role, fmt

    def format(self, record: logging.LogRecord) -> str:
        severity = ("E" if record.levelno >= logging.ERROR else
                    "W" if record.levelno >= logging.WARNING else "I")
        t = time.gmtime(record.created)
        if self.fmt == "ISO8601":
            head = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', t)} {severity}"
        else:
            usec = int((record.created % 1) * 1e6)
            head = f"{severity}{time.strftime('%m%d %H:%M:%S', t)}.{usec:06d}"
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        return f"{head} {record.process} {self.role}/{record.filename}:{record.lineno}] {text}"


class AppendHandler(logging.Handler):
    """Writes each record with one write(2) on an O_APPEND descriptor (or stderr):
    the kernel appends it whole, so lines of several processes never interleave
    within a line (on a pipe, a record up to PIPE_BUF bytes is written whole)."""

    def __init__(self, fd: int, opts: LogOptions):
        super().__init__()
        self.fd, self.opts = fd, opts

    def filter(self, record: logging.LogRecord) -> bool:
        return self.opts.shows(record.levelno) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode(errors="replace")
            while data:  # a regular file takes it whole; a full pipe may take part
                data = data[os.write(self.fd, data):]
        except Exception as e:  # not handleError: it writes to sys.stderr, which in
            # a worker is a ModelOutput logging through this very handler
            try:
                os.write(2, f"shmserve: a log line was lost ({type(e).__name__}: {e})\n".encode())
            except OSError:
                pass


def open_log_file(path: str) -> int:
    """The descriptor every role appends to; created 0600 (the server's files are
    private by default), an existing file keeps its mode and contents."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def setup(opts: LogOptions, role: str) -> None:
    """Routes every record of this process through one handler: --log-file or
    stderr, the chosen format, the severities switched on. OSError if the log file
    cannot be opened. Uncaught exceptions are logged the same way."""
    fd = open_log_file(opts.file) if opts.file else sys.stderr.fileno()
    handler = AppendHandler(fd, opts)
    handler.setFormatter(TritonFormatter(role, opts.format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)  # other libraries' debug lines stay out even when verbose
    logging.getLogger("shmserve").setLevel(logging.DEBUG if opts.verbose else logging.INFO)

    def log_uncaught(kind, value, tb) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        while tb is not None and tb.tb_next is not None:  # the line that raised it
            tb = tb.tb_next
        where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb else ("?", 0)
        logger = logging.getLogger(f"shmserve.{role}")
        logger.handle(logger.makeRecord(logger.name, logging.ERROR, *where,
                                        "%s process died: uncaught %s", (role, kind.__name__),
                                        (kind, value, value.__traceback__)))

    sys.excepthook = log_uncaught


def reconfigure(opts: LogOptions) -> None:
    """Applies changed options (Triton's logging extension, server/settings.py) to the
    handler setup() gave this process: severities, verbosity, format, file. OSError if
    a new log file cannot be opened (the old one is kept)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, AppendHandler) or handler.opts == opts:
            continue
        if opts.file != handler.opts.file:
            fd = open_log_file(opts.file) if opts.file else 2  # stderr
            old, handler.fd = handler.fd, fd
            if handler.opts.file:
                os.close(old)
        handler.setFormatter(TritonFormatter(handler.formatter.role, opts.format))
        handler.opts = opts
    logging.getLogger("shmserve").setLevel(logging.DEBUG if opts.verbose else logging.INFO)


class ModelOutput(io.TextIOBase):
    """What a model writes to sys.stdout or sys.stderr, as log lines naming it: each
    complete line becomes one record (`model 'm' version 1 instance 0: text`) at the
    caller's file and line, through the same handler as every other line (so into
    --log-file when one is given). Partial lines wait for their newline or flush()."""

    encoding, errors = "utf-8", "strict"  # what code that inspects sys.stdout expects

    def __init__(self, who: str, levelno: int, fd: int):
        super().__init__()
        self.who, self.levelno, self.fd = who, levelno, fd
        self.log = logging.getLogger("shmserve.model")
        self.pending = ""
        self.lock = threading.Lock()  # a model's threads may print at once

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # code that writes to the descriptor bypasses the log
        return self.fd

    def write(self, text: str) -> int:
        caller = sys._getframe(1)  # print() is C: this is the model's frame
        with self.lock:
            lines = (self.pending + text).split("\n")
            self.pending = lines.pop()
        for line in lines:
            self.emit(line, caller)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            line, self.pending = self.pending, ""
        if line:
            self.emit(line, sys._getframe(1))

    def emit(self, line: str, frame) -> None:
        if not self.log.isEnabledFor(self.levelno):
            return
        record = self.log.makeRecord(self.log.name, self.levelno, frame.f_code.co_filename,
                                     frame.f_lineno, "%s: %s", (self.who, line.rstrip("\r")),
                                     None)
        self.log.handle(record)


def capture_model_output(who: str) -> None:
    """A worker's sys.stdout (info lines) and sys.stderr (warning lines) become log
    lines naming the model instance: its load report has a pipe of its own, so
    nothing is lost by taking stdout."""
    sys.stdout = ModelOutput(who, logging.INFO, 1)
    sys.stderr = ModelOutput(who, logging.WARNING, 2)
