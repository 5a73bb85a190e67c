"""Supervision of the coordinator's children: the batcher and one worker per model
instance are started (workers report on a pipe of their own whether their model
loaded), restarted with a backoff when they exit, and retired when they crash-loop.
Each start, exit, restart and retirement is one log line naming the child. A mixin
of Coordinator, whose state it uses.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import typing

from .. import protocol as P
from ..errors import ConfigError
from ..protocol import LAYOUT as L

log = logging.getLogger("shmserve.coordinator")
FRONT_NAMES = {"http": "HTTP", "grpc": "gRPC"}  # boot "protocol" -> shmserve/front/<protocol>.py
CRASH_LOOP = (5, 60.0)  # a worker that exits this many times in this many seconds is retired


@dataclasses.dataclass
class Child:
    role: str  # "batcher", "worker" or "front" (shmserve/front/http.py or grpc.py)
    boot: dict
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list = dataclasses.field(default_factory=list)  # monotonic times of recent exits
    retired: bool = False
    handshake: typing.BinaryIO | None = None  # the read end of a starting worker's report
    env: dict = dataclasses.field(default_factory=dict)  # set for it (devices.worker_environment)
    entry: typing.Any = None  # a worker's models.Entry

    def describe(self) -> str:
        """What the log names it by: its model instance (a worker) and its pid."""
        pid = f"pid {self.proc.pid}" if self.proc else "not running"
        if self.role == "front":
            return f"{FRONT_NAMES[self.boot['protocol']]} front {self.boot['index']}, {pid}"
        if self.role != "worker":
            return pid
        m = self.boot["model"]
        device = self.boot.get("device", -1)
        where = f" on GPU {device}" if device >= 0 else ""
        return (f"model '{m['name']}' version {m['version']} instance {self.boot['instance']}"
                f"{where}, {pid}")


def describe_exit(code: int) -> str:
    """A child's exit status in words: "exit code 3" or "signal SIGKILL"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


class Supervisor:
    def spawn(self, child: Child, handshake: bool = False) -> None:
        """Starts a child. Its stdout and stderr are the coordinator's stderr; its log
        lines go where the coordinator's go (shmserve/logs.py, which also turns a
        model's print() into log lines). With handshake, a pipe of its own (boot "handshake_fd") carries the
        worker's one-line report of whether its model loaded (read_handshake)."""
        if child.role == "batcher":  # a restarted one boots with the table as it is now
            child.boot["models"] = self.batcher_models()
            child.boot["table_epoch"] = self.table_epoch
        boot, keep = dict(child.boot), ()
        if child.role == "batcher":  # the table's changes come on a pipe of its own
            table_read, table_write = os.pipe()
            boot["table_fd"], keep = table_read, (table_read,)
            if self.table_pipe is not None:
                os.close(self.table_pipe)
            self.table_pipe = table_write
        if handshake:
            read_end, write_end = os.pipe()
            boot["handshake_fd"], keep = write_end, keep + (write_end,)
        # A worker's trace pipe (boot "trace") stays open here for its restarts.
        shared = (boot["trace"]["fd"],) if "trace" in boot else ()
        if child.role != "front":  # the batcher and the workers map both segments, inherited
            boot["server_fd"], boot["control_fd"] = self.server.fd, self.control.fd
            boot["bell_fd"] = self.bell.fd
            shared += (self.server.fd, self.control.fd, self.bell.fd)
        try:
            module = (f"shmserve.front.{boot['protocol']}" if child.role == "front"
                      else f"shmserve.server.{child.role}")
            child.proc = subprocess.Popen(
                [sys.executable, "-m", module], stdin=subprocess.PIPE,
                stdout=sys.stderr.fileno(), pass_fds=keep + shared,
                env={**os.environ, **child.env} if child.env else None)
        except BaseException:
            if handshake:
                os.close(read_end)
            raise
        finally:
            for fd in keep:
                os.close(fd)  # the child's copy is the only writer left
        child.handshake = os.fdopen(read_end, "rb") if handshake else None
        child.proc.stdin.write((json.dumps(boot) + "\n").encode())
        child.proc.stdin.close()
        if child.restarts:
            log.info("%s restarted: %s (restart %d)", child.role, child.describe(), child.restarts)
        else:
            log.info("%s started: %s", child.role, child.describe())

    def read_handshake(self, child: Child, deadline: float) -> dict:
        """A worker's one-line load report, or why there is none."""
        ready, _, _ = select.select([child.handshake], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            child.proc.kill()
            child.proc.wait()
            return {"error": f"did not load within {self.opts.load_timeout_s:.0f} s"}
        line = child.handshake.readline()
        try:
            return json.loads(line) if line else {}
        except ValueError:
            return {}

    def start_children(self) -> None:
        """At start: the batcher and every worker of the table's models; waits for
        each worker's load report (at most --load-timeout)."""
        started = time.monotonic()
        deadline = started + self.opts.load_timeout_s
        for problem in self.table.all_problems():  # never loaded, never started
            log.error("model failed to load: '%s'%s: %s (UNAVAILABLE)", problem.name,
                      "" if problem.version is None else f" version {problem.version}",
                      problem.reason)
        for e in self.table.all():
            spec = e.spec
            log.info("model loading: '%s' version %d (%s backend, %d instance%s, "
                     "max_batch_size %d)", spec.name, spec.version, spec.backend,
                     spec.instance_count, "s" * (spec.instance_count != 1), spec.max_batch_size)
        for child in self.children:
            self.spawn(child, handshake=child.role == "worker")
        # Workers say on their handshake pipe whether their model loaded.
        for child in self.children:
            if child.role != "worker":
                continue
            e = child.entry
            msg = self.read_handshake(child, deadline)
            if msg.get("ready"):
                if e.state == "LOADING":
                    e.state = "READY"
                # CLOCK_MONOTONIC is one clock for every process: the worker's own
                # time of readiness, not when this loop got round to reading it.
                e.loaded_s = max(e.loaded_s, msg.get("monotonic", time.monotonic()) - started)
            else:
                why = msg.get("error") or describe_exit(child.proc.wait())
                e.state = f"UNAVAILABLE: {why}"
                log.error("model failed to load: '%s' version %d (instance %d): %s",
                          e.name, e.version, child.boot["instance"], why)
            child.handshake.close()
            child.handshake = None
        for e in self.table.all():
            ready = e.state == "READY"
            if ready:
                log.info("model loaded: '%s' version %d, %d instance%s in %.2f s", e.name,
                         e.version, len(e.mailboxes), "s" * (len(e.mailboxes) != 1),
                         e.loaded_s)
            self.server.ops.store32(self.layout.model(e.index) + L["model.ready"], int(ready))

    async def start_fronts(self, protocol: str, address: str, port: int, count: int) -> None:
        """Starts `count` fronts of a protocol (shmserve/front/<protocol>.py) once the
        control socket accepts their leases; waits until each listens, or says why not."""
        o = self.opts
        name = FRONT_NAMES[protocol]
        arena = min(max(o.default_arena_bytes, 256 << 20), o.max_arena_bytes)
        deadline = time.monotonic() + o.load_timeout_s
        extra = {"grpc_options": o.grpc_options} if protocol == "grpc" else {}
        fronts = [Child("front", self.boot_message(
            index=i, protocol=protocol, address=address, port=port, arena_bytes=arena, **extra))
            for i in range(count)]
        loop = asyncio.get_running_loop()
        for child in fronts:
            self.spawn(child, handshake=True)
            self.children.append(child)
        for child in fronts:  # in a thread: this loop must answer their hellos meanwhile
            msg = await loop.run_in_executor(None, self.read_handshake, child, deadline)
            child.handshake.close()
            child.handshake = None
            if not msg.get("ready"):
                raise ConfigError(f"{name} front {child.boot['index']} did not start: "
                                  f"{msg.get('error') or describe_exit(child.proc.wait())}")
        log.info("%s service on %s://%s:%d (%d front process%s)", name, protocol, address,
                 port, len(fronts), "es" * (len(fronts) != 1))

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restarts children that exit, with a backoff that grows with their recent
        exits; each restart is its own timer, so one waiting restart delays no other."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            for child in self.children:
                code = child.proc.poll() if child.proc else None
                if code is None or child.retired:
                    continue  # running, retired, or a restart already scheduled
                if child.role == "worker" and child.entry.state != "READY":
                    continue  # never loaded (UNAVAILABLE), loading or unloading
                now = time.monotonic()
                child.exits = [t for t in child.exits if now - t < CRASH_LOOP[1]] + [now]
                if child.role == "worker" and len(child.exits) >= CRASH_LOOP[0]:
                    self.retire(child, code)
                    continue
                child.restarts += 1
                delay = min(0.1 * 2 ** len(child.exits), 5.0)
                log.error("%s exited: %s, %s; restart %d in %.1f s", child.role, child.describe(),
                          describe_exit(code), child.restarts, delay)
                if child.role == "worker":  # no dispatch to it until the new one loaded
                    mb = self.layout.mailbox(child.boot["worker_index"])
                    self.server.ops.store32(mb + L["mailbox.pid"], 0)
                child.proc = None
                loop.call_later(delay, lambda c=child: stop.is_set() or self.spawn(c))
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    def retire(self, child: Child, code) -> None:
        """A crash-looping worker is not restarted again. The batcher answers its
        batch; once no instance of its model is left, the model is UNAVAILABLE."""
        log.error("worker retired: %s: exited %d times in %.0f s (last: %s), not restarted",
                  child.describe(), CRASH_LOOP[0], CRASH_LOOP[1], describe_exit(code))
        child.retired, child.proc = True, None
        e = child.entry
        spec = e.spec
        mb = self.layout.mailbox(child.boot["worker_index"])
        self.server.ops.store32(mb + L["mailbox.pid"], P.MAILBOX_RETIRED)
        if all(c.retired for c in e.workers):
            e.state = (f"UNAVAILABLE: its worker crashed {CRASH_LOOP[0]} times "
                       f"in {CRASH_LOOP[1]:.0f} s (last {describe_exit(code)})")
            self.server.ops.store32(self.layout.model(e.index) + L["model.ready"], 0)
            log.error("model unavailable: '%s' version %d: every instance was retired",
                      spec.name, spec.version)
        self.control.ops.ring_batcher(self.bell.ops)
