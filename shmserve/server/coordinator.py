"""Coordinator process (`shmserve serve`): reads the repository, creates the
segments, starts and supervises the batcher and the workers, and serves the control
socket (one connection = one client lease). It never touches tensor bytes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

from .. import protocol as P
from ..errors import ConfigError, ShmServeError, ShmSpaceError
from ..protocol import LAYOUT as L
from .repository import ModelSpec, load_repository
from ..segments import Segment, pid_alive, socket_path
from .segments import (ArenaLayout, ServerLayout, control_size, create_named, create_sealed,
                       init_control, new_prefix, read_record, record_path, remove_segments,
                       resolve_group, share_with_group, unreachable_by_group,
                       write_record)

log = logging.getLogger("shmserve.coordinator")
LEASE_QUARANTINE_S = 5.0  # a dead lease's id is not reused before in-flight work drains
CRASH_LOOP = (5, 60.0)  # a worker that exits this many times in this many seconds is retired


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
    load_timeout_s: float = 120.0
    metrics_port: int | None = None  # Prometheus /metrics; off unless given
    metrics_address: str = "127.0.0.1"
    log_level: str = "INFO"
    group: str | None = None  # let this group's members be clients (the socket becomes 0660)


class AlreadyRunningError(ShmServeError):
    pass


@dataclasses.dataclass
class Child:
    role: str  # "batcher" or "worker"
    boot: dict
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list = dataclasses.field(default_factory=list)  # monotonic times of recent exits
    retired: bool = False


class Coordinator:
    def __init__(self, opts: ServeOptions):
        self.opts = opts
        self.specs: list[ModelSpec] = []
        self.model_state: dict[int, str] = {}  # READY / UNAVAILABLE: reason
        self.children: list[Child] = []
        self.control: Segment | None = None
        self.server: Segment | None = None
        self.layout: ServerLayout | None = None
        self.leases: dict[int, dict] = {}
        self.dead_since: dict[int, float] = {}
        self.prefix = new_prefix()
        self.sock_path = socket_path(opts.name)
        self.owns_name = False  # until claim_name: a refused start removes nothing
        self.connections: set[asyncio.StreamWriter] = set()
        self._arena_counter = 0
        self.gid: int | None = None  # --group: its members may be clients too

    # -- 1. start: name check, repository, segments, children --------------------
    def claim_name(self) -> None:
        """Refuses a second live server of the same name; cleans a dead one's leftovers."""
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
        rec = read_record(self.opts.name)
        if rec and not pid_alive(rec.get("pid", 0)):
            removed = remove_segments(rec["prefix"])
            if removed:
                log.info("cleaned %d segments of a dead server (pid %s)", len(removed), rec["pid"])
        self.sock_path.unlink(missing_ok=True)
        self.owns_name = True

    def create_segments(self) -> None:
        o = self.opts
        n_workers = sum(s.instance_count for s in self.specs)
        self.layout = ServerLayout(o.max_clients, o.slots_per_client, len(self.specs), n_workers)
        ring = 1
        while ring < max(o.max_clients * o.slots_per_client, 64):
            ring <<= 1
        # Records first, so that a crash from here on can be cleaned by the next start.
        write_record(o.name, {"pid": os.getpid(), "prefix": self.prefix, "socket": str(self.sock_path)})
        self.control = create_sealed("shmserve-control", control_size(ring),
                                     what="control segment (request ring)")
        self.server = create_named(self.prefix + "-srv", self.layout.size,
                                   what="server segment (--max-clients x --slots-per-client)")
        init_control(self.control.ops, ring, os.getpid())
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
        for model_id, spec in enumerate(self.specs):
            self.write_model_entry(model_id, spec)

    def write_model_entry(self, model_id: int, spec: ModelSpec) -> None:
        self.server.ops.write_model_entry(
            self.layout.model(model_id), spec.name, spec.version, spec.max_batch_size,
            [(t.name, t.dtype, t.dims) for t in spec.inputs],
            [(t.name, t.dtype, t.dims) for t in spec.outputs])

    def boot_message(self, **extra) -> dict:
        lay = self.layout
        return {"control": f"/proc/{os.getpid()}/fd/{self.control.fd}",
                "control_bytes": self.control.size, "server": self.server.name,
                "max_clients": lay.max_clients, "slots_per_client": lay.slots_per_client,
                "n_models": lay.n_models, "n_workers": lay.n_workers,
                "spin_us": self.opts.spin_us, "max_spin_us": self.opts.max_spin_us,
                "coordinator_pid": os.getpid(),
                "log_level": self.opts.log_level, **extra}

    def plan_children(self) -> None:
        worker_models = [m for m, s in enumerate(self.specs) for _ in range(s.instance_count)]
        self.children.append(Child("batcher", self.boot_message(
            models=[s.to_dict() for s in self.specs], worker_models=worker_models)))
        for index, model_id in enumerate(worker_models):
            self.children.append(Child("worker", self.boot_message(
                worker_index=index, model_id=model_id, model=self.specs[model_id].to_dict())))

    def spawn(self, child: Child, handshake: bool = False) -> None:
        """Starts a child; with handshake, its stdout is a pipe on which a worker says
        whether its model loaded (read by start_children)."""
        child.proc = subprocess.Popen([sys.executable, "-m", f"shmserve.server.{child.role}"],
                                      stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE if handshake else subprocess.DEVNULL)
        child.proc.stdin.write((json.dumps(child.boot) + "\n").encode())
        child.proc.stdin.close()

    def read_handshake(self, child: Child, deadline: float) -> dict:
        """A worker's one-line load report, or why there is none."""
        ready, _, _ = select.select([child.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            child.proc.kill()
            child.proc.wait()
            return {"error": f"did not load within {self.opts.load_timeout_s:.0f} s"}
        line = child.proc.stdout.readline()
        try:
            return json.loads(line) if line else {}
        except ValueError:
            return {}

    def start_children(self) -> None:
        deadline = time.monotonic() + self.opts.load_timeout_s
        for child in self.children:
            self.spawn(child, handshake=child.role == "worker")
        # Workers say on stdout whether their model loaded.
        for child in self.children:
            if child.role != "worker":
                continue
            model_id = child.boot["model_id"]
            msg = self.read_handshake(child, deadline)
            if msg.get("ready"):
                self.model_state.setdefault(model_id, "READY")
            else:
                why = msg.get("error") or f"worker exited with code {child.proc.wait()}"
                self.model_state[model_id] = f"UNAVAILABLE: {why}"
                log.error("model '%s' version %d failed to load: %s",
                          self.specs[model_id].name, self.specs[model_id].version, why)
            child.proc.stdout.close()
        for model_id in range(len(self.specs)):
            ready = self.model_state.get(model_id) == "READY"
            self.server.ops.store32(self.layout.model(model_id) + L["model.ready"], int(ready))

    # -- 2. leases ----------------------------------------------------------------
    def open_lease(self, hello: P.Hello, peer_pid: int, peer_uid: int) -> P.HelloReply:
        if hello.version != P.PROTOCOL_VERSION:
            raise ShmServeError(f"protocol version {hello.version} not supported "
                                f"(server speaks {P.PROTOCOL_VERSION})", P.Status.INVALID_ARG)
        want = hello.arena_bytes or self.opts.default_arena_bytes
        if want <= 0 or want > self.opts.max_arena_bytes:
            raise ShmServeError(f"arena of {want} bytes refused: this server allows 1 byte to "
                                f"{self.opts.max_arena_bytes} bytes (--max-arena-bytes)",
                                P.Status.INVALID_ARG)
        now = time.monotonic()
        client_id = None
        for cid in range(self.layout.max_clients):
            if cid in self.leases:
                continue
            if now - self.dead_since.get(cid, -1e9) < LEASE_QUARANTINE_S:
                continue
            client_id = cid
            break
        if client_id is None:
            raise ShmServeError(f"server has {self.opts.max_clients} clients already "
                                "(--max-clients)", P.Status.BUSY)
        entry = self.layout.client(client_id)
        srv = self.server.ops
        generation = (srv.load32(entry + L["client_entry.generation"]) + 1) & 0xFFFFFFFF
        alayout = ArenaLayout.for_data(self.layout.slots_per_client, want)
        self._arena_counter += 1
        arena = create_sealed(f"shmserve-arena-{client_id}-{self._arena_counter}",
                               alayout.segment_bytes, what=f"arena of client pid {peer_pid}")
        arena.ops.init_arena(alayout.n_slots, want, client_id, generation)
        # The batcher and workers open the arena through this process's descriptor.
        path = f"/proc/{os.getpid()}/fd/{arena.fd}"
        srv.write_client_entry(entry, generation, peer_pid, peer_uid, alayout.segment_bytes, path)
        self.leases[client_id] = {"arena": arena, "pid": peer_pid}
        log.info("lease %d opened for pid %d (%.1f MiB arena)", client_id, peer_pid, want / 2**20)
        return P.HelloReply(
            client_id=client_id, generation=generation, control_bytes=self.control.size,
            arena_bytes=alayout.segment_bytes, slots_offset=alayout.slots_offset,
            n_slots=alayout.n_slots, data_offset=alayout.data_offset, server_pid=os.getpid(),
            spin_us=self.opts.spin_us, models=[dataclasses.asdict(m) for m in self.model_list()])

    def close_lease(self, client_id: int) -> None:
        lease = self.leases.pop(client_id, None)
        if lease is None:
            return
        entry = self.layout.client(client_id)
        self.server.ops.store32(entry + L["client_entry.state"], P.ClientState.DEAD)
        self.dead_since[client_id] = time.monotonic()
        lease["arena"].close()  # its memory goes when the last server mapping does
        # The head of the ring may hold a claim of this client: let the batcher look.
        self.control.ops.doorbell_ring(L["control.doorbell"], L["control.batcher_sleeping"])
        log.info("lease %d closed (pid %d)", client_id, lease["pid"])

    # -- 3. control-socket requests ------------------------------------------------
    def model_list(self) -> list[P.ModelMetadata]:
        return [self.metadata(model_id) for model_id in range(len(self.specs))]

    def metadata(self, model_id: int) -> P.ModelMetadata:
        return P.ModelMetadata(**self.specs[model_id].metadata(model_id),
                               state=self.model_state.get(model_id, "LOADING"))

    def find_model(self, name: str, version) -> int:
        matches = [i for i, s in enumerate(self.specs) if s.name == name]
        if not matches:
            known = sorted({s.name for s in self.specs})
            raise ShmServeError(f"unknown model '{name}' (serving: {', '.join(known)})",
                                P.Status.NOT_FOUND)
        if version in (None, "", 0, -1):
            return max(matches, key=lambda i: self.specs[i].version)
        for i in matches:
            if self.specs[i].version == int(version):
                return i
        raise ShmServeError(f"model '{name}' has no version {version} "
                            f"(available: {sorted(self.specs[i].version for i in matches)})",
                            P.Status.NOT_FOUND)

    def stats(self, name: str | None) -> list[dict]:
        out = []
        srv = self.server.ops
        for model_id, spec in enumerate(self.specs):
            if name and spec.name != name:
                continue
            row = {"name": spec.name, "version": spec.version,
                   "state": self.model_state.get(model_id, "LOADING")}
            row.update(srv.model_stats(self.layout.model(model_id)))
            out.append(row)
        return out

    def handle(self, msg: P.Message, lease: dict) -> P.Message:
        if isinstance(msg, P.Hello):
            if lease.get("client_id") is not None:
                raise ShmServeError("hello sent twice on one connection", P.Status.INVALID_ARG)
            reply = self.open_lease(msg, lease["pid"], lease["uid"])
            lease["client_id"] = reply.client_id
            lease["send_fds"] = [self.leases[reply.client_id]["arena"].fd, self.control.fd]
            return reply
        if isinstance(msg, P.ListModels):
            return P.ModelList([dataclasses.asdict(m) for m in self.model_list()])
        if isinstance(msg, P.GetMetadata):
            return self.metadata(self.find_model(msg.model, msg.version))
        if isinstance(msg, P.GetConfig):
            return P.ModelConfig(self.specs[self.find_model(msg.model, msg.version)].config_text)
        if isinstance(msg, P.GetStats):
            return P.StatsReply(self.stats(msg.model))
        raise ShmServeError(f"control operation {msg.OP!r} is not served", P.Status.INVALID_ARG)

    async def on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid, gid = struct.unpack("<iII", creds)  # struct ucred
        lease = {"pid": pid, "uid": uid, "client_id": None}
        if uid not in (os.getuid(), 0) and not (
                self.gid is not None and (gid == self.gid or self.gid in peer_groups(sock))):
            log.warning("refused a connection from uid %d gid %d pid %d: not this server's "
                        "user%s", uid, gid, pid, f" nor of group {self.opts.group}" if self.gid
                        is not None else "")
            writer.close()
            return
        self.connections.add(writer)
        try:
            while True:
                try:
                    reply = self.handle(P.decode_request(await P.read_frame(reader)), lease)
                except ShmServeError as e:
                    reply = P.ErrorReply(int(e.code), e.msg, type(e).__name__)
                except (ValueError, TypeError, OverflowError, KeyError) as e:
                    reply = P.ErrorReply(int(P.Status.INVALID_ARG),
                                         f"malformed control message: {type(e).__name__}: {e}")
                fds = lease.pop("send_fds", None)
                if fds is None:
                    writer.write(P.pack_frame(reply))
                else:
                    await send_with_fds(writer, P.pack_frame(reply), fds)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.connections.discard(writer)
            if lease["client_id"] is not None:
                self.close_lease(lease["client_id"])
            writer.close()

    # -- 4. supervision and shutdown -------------------------------------------------
    async def supervise(self, stop: asyncio.Event) -> None:
        """Restarts children that exit, with a backoff that grows with their recent
        exits; each restart is its own timer, so one waiting restart delays no other."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            for child in self.children:
                code = child.proc.poll() if child.proc else None
                if code is None or child.retired:
                    continue  # running, retired, or a restart already scheduled
                if child.role == "worker" and not self.model_state.get(
                        child.boot["model_id"], "").startswith("READY"):
                    continue  # never loaded: reported as UNAVAILABLE, not restarted
                now = time.monotonic()
                child.exits = [t for t in child.exits if now - t < CRASH_LOOP[1]] + [now]
                if child.role == "worker" and len(child.exits) >= CRASH_LOOP[0]:
                    self.retire(child, code)
                    continue
                child.restarts += 1
                delay = min(0.1 * 2 ** len(child.exits), 5.0)
                log.error("%s (pid %d) exited with code %s; restart %d in %.1fs", child.role,
                          child.proc.pid, code, child.restarts, delay)
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
        child.retired, child.proc = True, None
        model_id = child.boot["model_id"]
        spec = self.specs[model_id]
        mb = self.layout.mailbox(child.boot["worker_index"])
        self.server.ops.store32(mb + L["mailbox.pid"], P.MAILBOX_RETIRED)
        log.error("model '%s' instance %d exited %d times in %.0f s (last exit code %s): retired",
                  spec.name, child.boot["worker_index"], CRASH_LOOP[0], CRASH_LOOP[1], code)
        siblings = [c for c in self.children if c.role == "worker" and c.boot["model_id"] == model_id]
        if all(c.retired for c in siblings):
            self.model_state[model_id] = (f"UNAVAILABLE: its worker crashed {CRASH_LOOP[0]} times "
                                          f"in {CRASH_LOOP[1]:.0f} s (last exit code {code})")
            self.server.ops.store32(self.layout.model(model_id) + L["model.ready"], 0)
        self.control.ops.doorbell_ring(L["control.doorbell"], L["control.batcher_sleeping"])

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
        for lease in list(self.leases.values()):
            lease["arena"].close()
        self.leases.clear()
        for seg in (self.control, self.server):
            if seg is not None:
                seg.unlink()
                seg.close()
        if self.owns_name:
            self.sock_path.unlink(missing_ok=True)
            rec = read_record(self.opts.name)
            if rec and rec.get("pid") == os.getpid():
                record_path(self.opts.name).unlink(missing_ok=True)
        log.info("stopped; segments removed")

    async def serve(self, ready_fd: int | None = None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = await asyncio.start_unix_server(self.on_connection, path=str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        if self.gid is not None:
            share_with_group(self.sock_path, self.gid, 0o660)
            log.info("clients of group %s (gid %d) are allowed", self.opts.group, self.gid)
        self.control.ops.store32(L["control.server_state"], P.ServerState.READY)
        for model_id, spec in enumerate(self.specs):
            log.info("model '%s' version %d: %s (%s, %d instance%s, max_batch_size %d)",
                     spec.name, spec.version, self.model_state.get(model_id), spec.backend,
                     spec.instance_count, "s" * (spec.instance_count > 1), spec.max_batch_size)
        log.info("ready: server '%s', control socket %s", self.opts.name, self.sock_path)
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        metrics = None
        if self.opts.metrics_port is not None:
            from .metrics import serve_metrics

            metrics = serve_metrics(lambda: self.stats(None), self.opts.metrics_port,
                                    self.opts.metrics_address)
            log.info("metrics on http://%s:%d/metrics", self.opts.metrics_address,
                     self.opts.metrics_port)
        supervisor = asyncio.create_task(self.supervise(stop))
        await stop.wait()
        log.info("stopping")
        self.control.ops.store32(L["control.server_state"], P.ServerState.STOPPED)
        server.close()
        for writer in list(self.connections):
            writer.close()
        await supervisor
        if metrics is not None:
            metrics[0].shutdown()


def peer_groups(sock) -> set[int]:
    """The supplementary groups of a Unix-socket peer (SO_PEERGROUPS, Linux 4.13)."""
    so_peergroups = getattr(socket, "SO_PEERGROUPS", 59)
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, so_peergroups, 4 * 1024)
    except OSError:
        return set()
    return set(struct.unpack(f"<{len(raw) // 4}I", raw))


async def send_with_fds(writer: asyncio.StreamWriter, frame: bytes, fds: list[int]) -> None:
    """Sends a frame with fds attached (SCM_RIGHTS) on its first bytes. The transport
    cannot carry descriptors, so this goes straight to the socket, once everything
    the transport holds is out (frames stay in order)."""
    while writer.transport.get_write_buffer_size():
        await asyncio.sleep(0.001)
    sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
    try:
        while True:
            try:
                sent = socket.send_fds(sock, [frame], fds)
                break
            except BlockingIOError:
                await asyncio.sleep(0.001)
    finally:
        sock.close()  # the duplicate; the transport's own descriptor stays open
    if sent < len(frame):
        writer.write(frame[sent:])


def run(opts: ServeOptions, ready_fd: int | None = None) -> int:
    """Runs a server until SIGINT/SIGTERM. Returns a process exit code."""
    logging.basicConfig(level=opts.log_level, format="[shmserve] %(message)s")
    coord = Coordinator(opts)
    try:
        if opts.group is not None:
            try:
                coord.gid = resolve_group(opts.group)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        coord.claim_name()
        coord.specs = load_repository(opts.model_repository)
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
    finally:
        coord.shutdown()
