"""Coordinator process (`shmserve serve`): reads the repository, creates the
segments, starts and supervises the batcher and the workers (supervisor.py), and
serves the control socket, one connection = one client lease (control.py). It never
touches tensor bytes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .. import protocol as P
from ..errors import ConfigError, ShmServeError, ShmSpaceError
from ..logs import LogOptions, setup as setup_logging
from ..protocol import LAYOUT as L
from ..segments import Segment, socket_path
from . import devices
from .control import ControlPlane
from .cpu_watch import CpuWatch, watch as watch_cpus
from .placement import Placement
from .models import ModelControl, ModelTable, version_fingerprint
from .repository import (ModelProblem, ModelSpec, load_model, model_fingerprint,
                         problems_message, scan_repository)
from .supervisor import Child, Supervisor, describe_exit
from .settings import RuntimeSettings
from .system_shm import SystemShmRegistry
from .tracing import TraceConfig, start_tracing
from .segments import (ArenaLayout, ServerLayout, bell_size, control_size, create_sealed,
                       init_control, read_record, record_path,
                       resolve_group, share_with_group, unreachable_by_group,
                       write_record)

log = logging.getLogger("shmserve.coordinator")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops cleanly


@dataclasses.dataclass
class ServeOptions:
    model_repository: str
    name: str = "default"
    max_clients: int = 64
    slots_per_client: int = 32
    default_arena_bytes: int = 32 << 20
    max_arena_bytes: int = 1 << 30
    spin_us: int = 50  # batcher and workers spin (yielding) at least this long before sleeping
    max_spin_us: int = 200  # ... and up to this long when requests come that often
    cpu_watch_ms: int = 100  # how often cpu_watch looks for an idle CPU to spin on; 0: never
    colocate_when_crowded: bool = True  # crowded: batcher and workers on the callers' CPU
    load_timeout_s: float = 120.0
    exit_timeout_s: float = 30.0  # a stop waits this long for requests in flight (Triton's)
    cuda_pools: dict = dataclasses.field(default_factory=dict)  # GPU -> bytes (devices.py)
    pinned_pool_bytes: int | None = None  # --pinned-memory-pool-byte-size: not used yet
    cache_bytes: int = 0  # --cache-config local,size=: the response cache (response_cache.py)
    idle_check_ms: int = 100  # an idle batcher checks the coordinator this often; no request waits for it
    max_queued_per_client: int = 0  # requests of one client queued per model; 0: no limit
    metrics_port: int | None = None  # Prometheus /metrics; off unless given
    metrics_address: str = "127.0.0.1"
    metrics_config: dict = dataclasses.field(default_factory=dict)  # --metrics-config k=v
    metrics_interval_ms: int = 2000  # CPU/GPU gauges and summary windows refresh this often
    log_level: str = "info"  # older shorthand, folded into the Triton flags below
    log_verbose: int = 0  # Triton's logging flags (shmserve/logs.py)
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: str = "default"  # or "ISO8601"
    log_file: str | None = None  # every process appends to it; None: stderr
    group: str | None = None  # let this group's members be clients (the socket becomes 0660)
    exit_on_error: bool = True  # Triton's --exit-on-error: a broken model stops the start;
    # False: serve the good ones, the broken ones listed UNAVAILABLE with the reason
    auto_complete_config: bool = True  # Triton's default; --disable-auto-complete-config
    strict_readiness: bool = True  # Triton's --strict-readiness: ready = every model READY;
    # False: ready as soon as the server serves (its control socket answers)
    trace: TraceConfig | None = None  # --trace-config (tracing.py); None or level OFF: none
    http_port: int | None = None  # KServe v2 HTTP front (shmserve/front/); off unless given
    http_address: str = "127.0.0.1"
    http_thread_count: int = 1  # front processes sharing the port (SO_REUSEPORT)
    grpc_port: int | None = None  # KServe v2 gRPC front (shmserve/front/grpc.py); off unless given
    grpc_address: str = "127.0.0.1"
    grpc_infer_thread_count: int = 1  # gRPC front processes sharing the port
    grpc_options: dict = dataclasses.field(default_factory=dict)  # keep-alive, compression

    def fronts(self) -> list[tuple[str, str, int, int]]:
        """(protocol, address, port, process count) of each network front served."""
        return [(protocol, address, port, count) for protocol, address, port, count in
                (("http", self.http_address, self.http_port, self.http_thread_count),
                 ("grpc", self.grpc_address, self.grpc_port, self.grpc_infer_thread_count))
                if port is not None]
    model_control_mode: str = "none"  # Triton's: none, explicit or poll (models.py)
    load_model: list = dataclasses.field(default_factory=list)  # --load-model (explicit); "*": all
    repository_poll_secs: float = 15.0  # poll mode's rescan period (Triton's default)
    model_table_size: int | None = None  # model versions the table holds; None: see table_sizes
    max_model_instances: int | None = None  # instance workers (mailboxes); None: see table_sizes

    def table_sizes(self, specs: list[ModelSpec]) -> tuple[int, int]:
        """(model versions, instances) the table reserves room for. Mode none never
        changes the table: exactly what it starts with. Explicit and poll: the flags,
        by default twice the start's and at least 64 versions and 128 instances (a
        reload holds the old and the new version at once)."""
        versions, instances = len(specs), sum(s.instance_count for s in specs)
        if self.model_control_mode == "none":
            return max(versions, 1), max(instances, 1)
        return (max(64, 2 * versions) if self.model_table_size is None else self.model_table_size,
                max(128, 2 * instances) if self.max_model_instances is None
                else self.max_model_instances)

    def log_options(self) -> LogOptions:
        return LogOptions.with_level(
            self.log_level, verbose=self.log_verbose, info=self.log_info,
            warning=self.log_warning, error=self.log_error, format=self.log_format,
            file=os.path.abspath(self.log_file) if self.log_file else None)


class AlreadyRunningError(ShmServeError):
    pass


class Coordinator(ControlPlane, Supervisor, ModelControl):
    """The coordinator's state and its start and stop; the control plane (leases and
    control-socket requests, control.py) and the supervision of children
    (supervisor.py) are its other two concerns, in their own files."""

    def __init__(self, opts: ServeOptions):
        self.opts = opts
        # The model table (models.py): each model version served, its handle, state
        # and workers; the models that could not be loaded, with the reason.
        self.table = ModelTable(1, 1)
        self.table_lock = asyncio.Lock()  # one load, unload or poll at a time
        self.table_epoch = 0  # changes told to the batcher (ModelControl.tell_batcher)
        self.table_pipe: int | None = None  # the write end of the batcher's table pipe
        self.polled: dict[str, tuple] = {}  # poll mode: each model directory's fingerprint
        self.children: list[Child] = []
        self.control: Segment | None = None
        self.control_readonly_fd: int | None = None  # what clients get (hello)
        self.bell: Segment | None = None
        self.server: Segment | None = None
        self.layout: ServerLayout | None = None
        self.leases: dict[int, dict] = {}
        self.dead_since: dict[int, float] = {}
        self.sock_path = socket_path(opts.name)
        self.owns_name = False  # until claim_name: a refused start removes nothing
        self.connections: set[asyncio.StreamWriter] = set()
        self._arena_counter = 0
        self.gid: int | None = None  # --group: its members may be clients too
        self.started_at = time.monotonic()
        self.stopping = False
        self.traces = None  # tracing.TraceSink (its pipe stays while tracing is off)
        self.settings = None  # settings.RuntimeSettings: the logging and trace extensions'
        self.cpu_watch = CpuWatch(len(os.sched_getaffinity(0)))
        self.placement = Placement(os.sched_getaffinity(0))
        self.port_claims: list[socket.socket] = []  # --http-port/--grpc-port, bound before the start
        self.system_shm = SystemShmRegistry()  # regions registered through the fronts

    # -- 1. start: name check, repository, segments, children --------------------
    def claim_name(self) -> None:
        """Refuses a second live server of the same name; cleans a dead one's leftovers
        (its socket and model files: its segments were memfds, gone with its processes)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.sock_path))
        except OSError:
            pass
        else:
            rec = read_record(self.opts.name) or {}
            raise AlreadyRunningError(
                f"a shmserve server named '{self.opts.name}' is already running "
                f"(pid {rec.get('pid', '?')}, socket {self.sock_path}); stop it or use --name")
        finally:
            s.close()
        self.sock_path.unlink(missing_ok=True)
        self.owns_name = True
        shutil.rmtree(self.model_files_root, ignore_errors=True)  # a dead predecessor's

    def claim_ports(self) -> None:
        """Binds each front's port (SO_REUSEPORT, never listening: it gets no
        connection) so that a port taken by another program stops the start at once,
        naming it."""
        for protocol, address, port, _ in self.opts.fronts():
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            claim = socket.socket(family, socket.SOCK_STREAM)
            self.port_claims.append(claim)
            claim.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            claim.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                claim.bind((address, port))
            except OSError as e:
                raise ConfigError(f"--{protocol}-port {port} (--{protocol}-address {address}): "
                                  f"{e.strerror or e}") from None

    def create_segments(self) -> None:
        o = self.opts
        self.layout = ServerLayout(o.max_clients, o.slots_per_client, self.table.capacity,
                                   self.table.max_instances)
        write_record(o.name, {"pid": os.getpid(), "socket": str(self.sock_path)})
        self.control = create_sealed("shmserve-control", control_size(), what="control segment")
        # Clients get the control block read-only: a descriptor reopened O_RDONLY cannot
        # be mapped writable, and mode 0400 keeps a caller of another uid from reopening
        # its /proc/self/fd entry for writing (a memfd is made 0777; the server processes
        # map the descriptors they inherit, whatever the mode). The bell is the one page
        # they all write (its doorbell).
        os.fchmod(self.control.fd, 0o400)
        self.control_readonly_fd = os.open(f"/proc/self/fd/{self.control.fd}",
                                           os.O_RDONLY | os.O_CLOEXEC)
        self.bell = create_sealed("shmserve-bell", bell_size(), what="bell segment")
        # No name anyone could open or squat: the batcher and the workers inherit its
        # descriptor (supervisor.spawn), restarted ones included.
        self.server = create_sealed("shmserve-server", self.layout.size,
                                    what="server segment (--max-clients x --slots-per-client)")
        init_control(self.control.ops, os.getpid())
        if self.gid is not None:  # group clients must reach the socket
            share_with_group(self.sock_path.parent, self.gid, 0o710)
            blocked = unreachable_by_group(self.sock_path.parent, self.gid)
            if blocked is not None:
                log.warning("group %s cannot reach the socket: %s is not traversable by it; "
                            "set SHMSERVE_RUNTIME_DIR to a directory it can reach",
                            self.opts.group, blocked)
        lay = self.layout
        self.server.ops.init_server(lay.max_clients, lay.slots_per_client, lay.n_models,
                                    lay.n_workers)
        for e in self.table.all():
            self.write_model_entry(e.index, e.spec, e.generation)

    def boot_message(self, **extra) -> dict:
        lay = self.layout
        return {"control_bytes": self.control.size, "bell_bytes": self.bell.size,
                # the segments' fds: supervisor.spawn
                "max_clients": lay.max_clients, "slots_per_client": lay.slots_per_client,
                "n_models": lay.n_models, "n_workers": lay.n_workers,
                "spin_us": self.opts.spin_us, "max_spin_us": self.opts.max_spin_us,
                "idle_check_ms": self.opts.idle_check_ms,
                "max_queued_per_client": self.opts.max_queued_per_client,
                "coordinator_pid": os.getpid(),
                "server_name": self.opts.name, "socket": str(self.sock_path),  # BLS clients
                "log": self.settings.log_options.as_dict(), "settings": self.settings.page.path,
                **extra}

    def plan_children(self) -> None:
        # The batcher's models and table epoch are filled in at each (re)start (spawn).
        self.children.append(Child("batcher", self.boot_message()))
        for e in self.table.all():
            self.worker_children(e)

    # -- 3. shutdown ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops children, answers nobody (callers see STOPPED), removes every segment."""
        if self.control is not None:
            self.control.ops.store32(L["control.server_state"], P.ServerState.STOPPED)
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + 3
        for child in self.children:
            if child.proc:
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
                log.info("%s exited: %s, %s", child.role, child.describe(),
                         describe_exit(child.proc.returncode))
        for e in self.table.all():
            if e.state in ("READY", "UNLOADING"):
                log.info("model unloaded: '%s' version %d", e.name, e.version)
        if self.traces is not None:  # the workers are gone: what they sent is all there is
            try:
                self.traces.close()
            except Exception as e:  # the segments below must go whatever happened here
                log.error("traces: could not finish: %s", e)
        self.system_shm.close()
        if self.settings is not None:
            self.settings.close()
        for lease in list(self.leases.values()):
            lease["arena"].close()
        self.leases.clear()
        if self.table_pipe is not None:
            os.close(self.table_pipe)
            self.table_pipe = None
        for seg in (self.control, self.bell, self.server):
            if seg is not None:
                seg.close()
        if self.control_readonly_fd is not None:
            os.close(self.control_readonly_fd)
            self.control_readonly_fd = None
        if self.owns_name:
            self.sock_path.unlink(missing_ok=True)
            shutil.rmtree(self.model_files_root, ignore_errors=True)  # file loads' (models.py)
            rec = read_record(self.opts.name)
            if rec and rec.get("pid") == os.getpid():
                record_path(self.opts.name).unlink(missing_ok=True)
        for claim in self.port_claims:
            claim.close()
        if self.owns_name:
            log.info("server stopped: '%s', segments removed", self.opts.name)

    async def drain(self, force: asyncio.Event) -> None:
        """Lets the requests in flight finish, at most --exit-timeout-secs: the batcher
        refuses the ones pushed from now on (UNAVAILABLE, "the server is stopping"),
        those pushed before are answered as usual."""
        # SYNC POINT: pairs with the batcher's load of drain_since_ns in Intake.take.
        self.server.ops.store64(L["server.drain_since_ns"], P.now_ns())
        self.control.ops.ring_batcher(self.bell.ops)
        deadline = time.monotonic() + self.opts.exit_timeout_s
        left = self.in_flight()
        if left:
            log.info("stopping: %d request(s) in flight, waiting at most %.0f s "
                     "(--exit-timeout-secs)", left, self.opts.exit_timeout_s)
        while left and time.monotonic() < deadline and not force.is_set():
            await asyncio.sleep(0.01)
            left = self.in_flight()
        if left:
            log.warning("stopping with %d request(s) unanswered (%s)", left,
                        "second signal" if force.is_set() else "exit timeout")

    def our_pids(self) -> list[int]:
        """This server's processes and its clients': their CPU is not other work's."""
        return ([os.getpid()] + [c.proc.pid for c in self.children if c.proc]
                + [lease["pid"] for lease in self.leases.values()])

    def place(self, crowded: bool) -> None:
        """cpu_watch's verdict, to where the batcher and the workers run (placement.py)."""
        server = [c.proc.pid for c in self.children
                  if c.proc and c.role in ("batcher", "worker")]
        if crowded and self.opts.colocate_when_crowded:
            self.placement.follow([lease["pid"] for lease in self.leases.values()], server)
        else:
            self.placement.release(server)

    def publish_crowded(self, crowded: bool) -> None:
        """cpu_watch's verdict, to the clients' waiters and to the server's own."""
        self.control.ops.store32(L["control.crowded"], int(crowded))

    def in_flight(self) -> int:
        """Requests of live leases the server holds (submitted, queued or running)."""
        busy = (P.SlotState.SUBMITTED, P.SlotState.QUEUED, P.SlotState.RUNNING)
        count = 0
        for client_id, lease in self.leases.items():
            layout = ArenaLayout(self.layout.slots_per_client, lease["arena"].size)
            ops = lease["arena"].ops
            count += sum(ops.load32(layout.slot(s) + L["slot.state"]) in busy
                         for s in range(layout.n_slots))
        return count

    async def serve(self, ready_fd: int | None = None) -> None:
        stop, force = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        stopped_by = []

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():
                force.set()
            else:
                stopped_by.append(sig.name)
                stop.set()

        for sig in STOP_SIGNALS:  # the first stops (draining), a second cuts the drain short
            loop.add_signal_handler(sig, on_signal, sig)
        server = await asyncio.start_unix_server(self.on_connection, path=str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        if self.gid is not None:
            share_with_group(self.sock_path, self.gid, 0o660)
            log.info("clients of group %s (gid %d) are allowed", self.opts.group, self.gid)
        for protocol, address, port, count in self.opts.fronts():
            await self.start_fronts(protocol, address, port, count)
        self.control.ops.store32(L["control.server_state"], P.ServerState.READY)
        ready = sum(e.state == "READY" for e in self.table.all())
        total = len(self.table.all()) + len(self.table.all_problems())
        log.info("server ready: '%s', control socket %s, %d of %d model%s READY%s", self.opts.name,
                 self.sock_path, ready, total, "s" * (total != 1),
                 "" if self.opts.model_control_mode == "none"
                 else f" (--model-control-mode {self.opts.model_control_mode})")
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        metrics = None
        if self.opts.metrics_port is not None:
            from .metrics import serve_metrics

            async def snapshot(histograms: bool) -> dict:
                return self.server_status(histograms)

            # The endpoint's thread reads the state in this loop, never beside it.
            metrics = serve_metrics(
                lambda histograms: asyncio.run_coroutine_threadsafe(
                    snapshot(histograms), loop).result(10),
                self.opts.metrics_port, self.opts.metrics_address,
                {**self.opts.metrics_config, "response_cache": self.opts.cache_bytes > 0},
                self.opts.metrics_interval_ms)
            log.info("metrics on http://%s:%d/metrics", self.opts.metrics_address,
                     self.opts.metrics_port)
        if self.traces is not None:
            loop.add_reader(self.traces.read_fd, self.traces.on_readable)
        supervisor = asyncio.create_task(self.supervise(stop))
        watcher = (asyncio.create_task(watch_cpus(
            self.cpu_watch, self.opts.cpu_watch_ms / 1000, self.our_pids, self.publish_crowded,
            stop, lambda: bool(self.leases), self.place)) if self.opts.cpu_watch_ms > 0 else None)
        poller = (asyncio.create_task(self.poll_repository(stop))
                  if self.opts.model_control_mode == "poll" else None)
        await stop.wait()
        if poller is not None:
            await poller
        log.info("server stopping: '%s' (%s)", self.opts.name, stopped_by[0])
        server.close()  # no new lease; the open ones stay, so their requests can be answered
        for child in self.children:  # fronts take no new request; theirs in flight drain
            if child.role == "front" and child.proc and child.proc.poll() is None:
                child.proc.terminate()
        await self.drain(force)
        self.stopping = True  # the connections closed now are closed by the server
        self.control.ops.store32(L["control.server_state"], P.ServerState.STOPPED)
        for writer in list(self.connections):
            writer.close()
        await supervisor
        if watcher is not None:
            await watcher
        if metrics is not None:
            metrics.shutdown()


def load_models(opts: ServeOptions) -> tuple[list[ModelSpec], list[ModelProblem]]:
    """The models to load at start and (with --exit-on-error=false) the broken ones;
    ConfigError naming every broken model when they stop the start. Modes none and
    poll: the whole repository; explicit: the --load-model ones ("*": all), maybe none."""
    explicit = opts.model_control_mode == "explicit"
    if opts.load_model and not explicit:
        raise ConfigError("--load-model is only for --model-control-mode explicit (the "
                          f"mode is {opts.model_control_mode}: every model loads)")
    if explicit and "*" not in opts.load_model:
        root = Path(opts.model_repository)
        if not root.is_dir():
            raise ConfigError(f"model repository {root} is not a directory")
        specs, problems = [], []
        for name in dict.fromkeys(opts.load_model):
            model_dir = root / name
            if not model_dir.is_dir():
                problems.append(ModelProblem(name, None, f"--load-model {name}: no model "
                                             f"directory {model_dir}"))
                continue
            try:
                specs.extend(load_model(model_dir, opts.auto_complete_config, problems))
            except ConfigError as e:
                problems.append(ModelProblem(name, None, e.msg))
            except (OSError, UnicodeDecodeError) as e:
                problems.append(ModelProblem(name, None, f"{model_dir}: {e}"))
    else:
        specs, problems = scan_repository(opts.model_repository, opts.auto_complete_config)
    if problems and opts.exit_on_error:
        raise ConfigError(problems_message(problems))
    if not specs and opts.model_control_mode == "none":
        # nothing to serve, and nothing could be loaded later: refused
        raise ConfigError(f"no model of repository {opts.model_repository} can be loaded:\n"
                          + problems_message(problems))
    return specs, problems


class StopRequested(Exception):
    """A stop signal came before the server was serving (while models load)."""


def _stop_while_starting(signum, frame) -> None:
    raise StopRequested(signal.Signals(signum).name)


def run(opts: ServeOptions, ready_fd: int | None = None) -> int:
    """Runs a server until SIGINT, SIGTERM or SIGHUP. Returns a process exit code."""
    try:
        setup_logging(opts.log_options(), "coordinator")
    except (ValueError, OSError) as e:
        setup_logging(LogOptions(), "coordinator")  # on stderr, so that the refusal is seen
        log.error("%s", e if isinstance(e, ValueError) else
                  f"--log-file {opts.log_file}: cannot open it for appending: {e.strerror or e}")
        return 2
    log.info("server starting: '%s', repository %s, pid %d", opts.name,
             os.path.abspath(opts.model_repository), os.getpid())
    coord = Coordinator(opts)
    # Until the event loop takes them over, a stop signal unwinds through shutdown()
    # (the default action would kill the process and leave its segments behind).
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_while_starting)
    try:
        if opts.group is not None:
            try:
                coord.gid = resolve_group(opts.group)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        coord.claim_name()
        coord.claim_ports()
        if opts.model_control_mode not in ("none", "explicit", "poll"):
            raise ConfigError(f"--model-control-mode {opts.model_control_mode!r}: one of none, "
                              "explicit, poll")
        if opts.model_control_mode == "poll" and not opts.repository_poll_secs > 0:
            raise ConfigError(f"--repository-poll-secs {opts.repository_poll_secs:g}: poll mode "
                              "needs a period > 0")
        if opts.model_control_mode == "poll":  # what the first poll compares with
            coord.polled = coord.repository_fingerprints()
        specs, problems = load_models(opts)
        capacity, instances = opts.table_sizes(specs)
        if instances < max(1, sum(s.instance_count for s in specs)):
            raise ConfigError(f"--max-model-instances {instances}: the models to load at start "
                              f"have {sum(s.instance_count for s in specs)} instances")
        if capacity < len(specs):
            raise ConfigError(f"--model-table-size {capacity}: {len(specs)} model versions to "
                              "load at start")
        try:
            coord.table = ModelTable(capacity, instances)
        except ValueError as e:
            raise ConfigError(f"--model-table-size: {e}") from None
        for p in problems:
            coord.table.problems.setdefault(p.name, []).append(p)
        for spec in specs:
            coord.table.add(spec, version_fingerprint(spec))
        devices.check_pools(opts.cuda_pools, opts.pinned_pool_bytes)
        coord.traces = start_tracing(opts.trace, coord.table.trace_names)
        coord.settings = RuntimeSettings(opts.log_options(), coord.traces.cfg, coord.traces)
        coord.create_segments()
        coord.plan_children()
        coord.start_children()
        try:
            import uvloop
            uvloop.run(coord.serve(ready_fd))
        except ImportError:  # pragma: no cover
            asyncio.run(coord.serve(ready_fd))
        return 0
    except (ConfigError, ShmSpaceError, AlreadyRunningError) as e:
        log.error("%s", e.msg)
        return 2
    except PermissionError as e:  # --group the server's user is not a member of
        log.error("%s", e)
        return 2
    except StopRequested as e:
        log.info("server stopping: '%s' (%s while starting: stopping)", opts.name, e)
        return 0
    finally:
        for sig in STOP_SIGNALS:  # a second signal during clean-up must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        coord.shutdown()
