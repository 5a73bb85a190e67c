"""`shmserve status`: a live view of a running server (docs/operating.md).

Each refresh is one `status` request on the control socket, sent without a hello, as
`shmserve health` asks: the viewer opens no lease and is not one of the clients it
shows. The reply is Coordinator.server_status(histograms=True): counters since the
server started. Rates and latencies are read from the difference of two replies,
over the time between them as the server measured it (the difference of its
`uptime_s`), so a slow refresh does not bend them:

- infer/s and req/s: inference_count and success + fail counts;
- p50 / p99: the `success` latency histograms (statistics.quantiles, within 6 %);
- queue / infer µs: the queue and compute_infer durations per request.

A model without a request in the interval (or the first frame, which has no earlier
reply) shows its latencies since the start, marked `*`.
"""
from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import protocol as P
from .server.statistics import dense, quantiles

NO_SERVER = 2  # as `shmserve health`
SINCE_START = "*"


@dataclass
class ModelRow:
    """One model version's line of the view; numbers, formatted by render()."""
    name: str
    version: str
    state: str                  # READY, LOADING, UNAVAILABLE: <reason>
    busy: int | None = None     # instances running a batch now
    instances: int | None = None
    restarting: int = 0
    restarts: int | None = None
    pending: int | None = None
    infer_per_s: float | None = None
    requests_per_s: float | None = None
    p50_ns: float | None = None
    p99_ns: float | None = None
    queue_us: float | None = None
    infer_us: float | None = None
    failures: dict | None = None
    since_start: bool = False   # latencies and means over the whole run, not the interval


def _requests(stat: dict) -> int:
    inf = stat["inference_stats"]
    return inf["success"]["count"] + inf["fail"]["count"]


def _mean_us(now: dict, before: dict | None) -> float | None:
    count = now["count"] - (before["count"] if before else 0)
    ns = now["ns"] - (before["ns"] if before else 0)
    return ns / count / 1000.0 if count > 0 else None


def model_row(stat: dict, before: dict | None, seconds: float | None) -> ModelRow:
    """A model's line from its model_stat now and `seconds` earlier (`before`, None
    when there is no earlier one or the counters went back: a restarted server)."""
    own = stat["shmserve"]
    live = [i for i in own["instances"] if i["state"] != "RETIRED"]
    row = ModelRow(
        stat["name"], str(stat["version"]), own["state"],
        busy=sum(i["state"] == "BUSY" for i in live), instances=len(live),
        restarting=sum(i["state"] == "RESTARTING" for i in live),
        restarts=sum(i["restarts"] for i in own["instances"]), pending=own["pending"],
        failures={k: v for k, v in own["failures"].items() if v})
    if before is not None and (seconds is None or seconds <= 0
                               or _requests(stat) < _requests(before)):
        before = None
    if before is not None:
        row.infer_per_s = (stat["inference_count"] - before["inference_count"]) / seconds
        row.requests_per_s = (_requests(stat) - _requests(before)) / seconds
    if before is None or _requests(stat) == _requests(before):
        before, row.since_start = None, True  # nothing in the interval: the whole run
    inf, old = stat["inference_stats"], before["inference_stats"] if before else None
    now_hist = dense(own["histograms"]["success"])
    if before is not None:
        now_hist = now_hist - dense(before["shmserve"]["histograms"]["success"])
    row.p50_ns, row.p99_ns = quantiles(np.maximum(now_hist, 0), (0.5, 0.99))
    row.queue_us = _mean_us(inf["queue"], old and old["queue"])
    row.infer_us = _mean_us(inf["compute_infer"], old and old["compute_infer"])
    if row.since_start and row.p50_ns is None and row.queue_us is None:
        row.since_start = False  # nothing since the start either: plain "-", no mark
    return row


def model_rows(now: dict, before: dict | None) -> list[ModelRow]:
    """Every model version of a status reply, then each model whose configuration is
    broken (served by no instance: its state only)."""
    seconds = now["uptime_s"] - before["uptime_s"] if before is not None else None
    earlier = {}
    if before is not None and seconds > 0:  # a restarted server's uptime went back
        earlier = {(s["name"], s["version"]): s for s in before["models"]}
    rows = [model_row(s, _same_load(s, earlier.get((s["name"], s["version"]))), seconds)
            for s in now["models"]]
    rows += [ModelRow(b["name"], str(b["version"] or "-"), b["state"]) for b in now["broken"]]
    return rows


def _same_load(now: dict, before: dict | None) -> dict | None:
    """The earlier sample of a model version, unless it was reloaded (or unloaded and
    loaded) in between: its counters started again from zero."""
    if before is None or now["execution_count"] < before["execution_count"]:
        return None
    return before


# -- rendering -----------------------------------------------------------------------

def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _uptime(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    return (f"{days}d " if days else "") + f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _state(text: str) -> Text:
    word = text.split(":", 1)[0].strip()
    return Text(text, style={"READY": "green", "LOADING": "yellow"}.get(word, "bold red"))


def header(name: str, status: dict, rows: list[ModelRow]) -> Table:
    batcher = status["batcher"]
    workers = {"SPIN": 0, "SLEEP": 0}
    for s in status["models"]:
        for inst in s["shmserve"]["instances"]:
            for how, n in inst["wakeups"].items():
                workers[how] = workers.get(how, 0) + n
    grid = Table.grid(padding=(0, 3))
    for _ in range(4):
        grid.add_column()
    grid.add_row(Text.assemble(("server ", "dim"), (name, "bold")),
                 Text.assemble(("up ", "dim"), _uptime(status["uptime_s"])),
                 Text.assemble(("rings ", "dim"),
                               f"{status['ring_depth']} / {status['ring_capacity']}"),
                 Text.assemble(("clients ", "dim"),
                               f"{len(status['clients'])} / {status['max_clients']}"))
    grid.add_row(Text.assemble(("batcher pid ", "dim"), str(batcher["pid"] or "-")),
                 Text.assemble(("restarts ", "dim"), f"batcher {batcher['restarts']}, "
                               f"instances {sum(r.restarts or 0 for r in rows)}"),
                 Text.assemble(("wake-ups batcher ", "dim"),
                               f"spin {batcher['wakeups'].get('SPIN', 0)} / "
                               f"sleep {batcher['wakeups'].get('SLEEP', 0)}"),
                 Text.assemble(("workers ", "dim"),
                               f"spin {workers['SPIN']} / sleep {workers['SLEEP']}"))
    watch = status.get("cpu_watch")  # servers before the CPU watch have none
    if watch:
        free = "-" if watch["free_cpus"] is None else f"{watch['free_cpus']:.1f}"
        spinning = ("off (crowded)" if watch["crowded"] else
                    "on (load not watched)" if not watch["interval_ms"] else
                    "on (no client: load not watched)" if watch.get("resting") else "on")
        home = watch.get("home_cpu")  # placement.py: servers before it have none
        placed = (f"CPU {home} (with the callers)" if home is not None else
                  "any CPU" if watch.get("colocate", True) else "any CPU (colocation off)")
        grid.add_row(Text.assemble(("CPUs free of other work ", "dim"), f"{free} / {watch['cpus']}"),
                     Text.assemble(("spinning ", "dim"), spinning),
                     Text.assemble(("server runs on ", "dim"), placed), "")
    return grid


def models_table(rows: list[ModelRow], seconds: float | None) -> Table:
    over = f"over the last {seconds:.1f} s" if seconds else "since the start"
    table = Table(box=box.MINIMAL, show_edge=False, title_justify="left",
                  caption_justify="left",
                  title=Text(f"models (rates and latencies {over})", style="bold"))
    for head in ("model", "version", "state"):
        table.add_column(head)
    for head in ("busy/inst", "restarts", "pending", "infer/s", "req/s", "p50 us", "p99 us",
                 "queue us", "infer us"):
        table.add_column(head, justify="right")
    table.add_column("failures")
    mark = SINCE_START
    for r in rows:
        if r.instances is None:  # a broken configuration: no instance, no counters
            table.add_row(Text(r.name), Text(r.version), _state(r.state),
                          *[Text("-")] * 9, Text("-"))
            continue
        inst = f"{r.busy}/{r.instances}" + (f" ({r.restarting} restarting)"
                                             if r.restarting else "")
        latency = [_us(r.p50_ns / 1000 if r.p50_ns is not None else None),
                   _us(r.p99_ns / 1000 if r.p99_ns is not None else None),
                   _us(r.queue_us), _us(r.infer_us)]
        if r.since_start:
            latency = [v + mark if v != "-" else v for v in latency]
        failures = ", ".join(f"{k} {v}" for k, v in r.failures.items()) or "-"
        table.add_row(Text(r.name), Text(r.version), _state(r.state), Text(inst),
                      Text(str(r.restarts)), Text(str(r.pending)), Text(_rate(r.infer_per_s)),
                      Text(_rate(r.requests_per_s)), *map(Text, latency),
                      Text(failures, style="red" if r.failures else ""))
    if any(r.since_start for r in rows):
        table.caption = Text(f"{mark} since the start: no request in the interval", style="dim")
    return table


def clients_table(clients: list[dict]) -> Table:
    table = Table(box=box.MINIMAL, show_edge=False, title=Text("clients", style="bold"),
                  title_justify="left")
    for head in ("client", "pid", "slots in use", "in flight", "arena"):
        table.add_column(head, justify="right")
    for c in clients:
        table.add_row(*map(Text, (str(c["client"]), str(c["pid"]),
                                  f"{c['slots_in_use']} / {c['slots']}",
                                  _bytes(c["bytes_in_flight"]), _bytes(c["arena_bytes"]))))
    if not clients:
        table.add_row(*[Text("-")] * 5)
    return table


def render(name: str, now: dict, before: dict | None = None) -> Group:
    """The frame for status reply `now`, rates and latencies over the time since
    `before` (an earlier reply of the same server, or None)."""
    rows = model_rows(now, before)
    seconds = now["uptime_s"] - before["uptime_s"] if before is not None else None
    return Group(header(name, now, rows), Text(""),
                 models_table(rows, seconds if seconds and seconds > 0 else None), Text(""),
                 clients_table(now["clients"]))


# -- the control socket ------------------------------------------------------------------

class StatusError(Exception):
    """The server answered the status request with an error (an older server)."""


class StatusSource:
    """One bare control-socket connection (no hello), kept across refreshes; fetch()
    reconnects after the connection was lost. Raises cli._NoServer when no server
    answers within `timeout` seconds."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self.sock: socket.socket | None = None

    def fetch(self) -> dict:
        from .cli import _NoServer, _control_call, _control_connect

        deadline = time.monotonic() + self.timeout
        if self.sock is None:
            self.sock = _control_connect(self.name, self.timeout)
        try:
            reply = _control_call(self.sock, P.GetStatus(), deadline, self.name)
        except _NoServer:
            self.close()
            raise
        if isinstance(reply, P.ErrorReply):
            raise StatusError(f"server '{self.name}' refused the status request: {reply.error}")
        return reply.status

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def print_frame(frame, console: Console) -> None:
    """A frame on a terminal as rich lays it out; into a pipe or a file, in lines as
    wide as the table (rich would fold them at 80 columns) without the padding."""
    if console.is_terminal:
        console.print(frame)
        return
    want = console.measure(frame, options=console.options.update_width(1000)).maximum
    wide = Console(width=max(want, console.width), color_system=None)
    with wide.capture() as captured:
        wide.print(frame)
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def run(name: str, interval: float = 1.0, once: bool = False, timeout: float = 5.0,
        console: Console | None = None) -> int:
    """`shmserve status`: 0, or NO_SERVER when none answers (at the start, or in
    --once mode at either sample); 1 when the server refuses the request."""
    from .cli import _NoServer

    console = console or Console()
    source = StatusSource(name, timeout)
    try:
        before = source.fetch()
        if once:  # two samples `interval` apart: rates need a difference
            time.sleep(interval)
            now = source.fetch()
            print_frame(render(name, now, before), console)
            return 0
        with Live(render(name, before), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                try:
                    now = source.fetch()
                except _NoServer as e:  # keep watching: the server may come back
                    live.update(Group(Text(f"{e}; retrying every {interval:g} s",
                                           style="bold red")), refresh=True)
                    before = None
                    continue
                live.update(render(name, now, before), refresh=True)
                before = now
    except _NoServer as e:
        print(f"shmserve status: {e}", file=sys.stderr)
        return NO_SERVER
    except StatusError as e:
        print(f"shmserve status: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        source.close()
