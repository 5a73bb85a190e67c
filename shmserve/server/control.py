"""The coordinator's control plane: leases (one per control-socket connection: an
arena, a client id, the client table entry) and the control-socket requests (typed
messages of shmserve.protocol.control). A mixin of Coordinator, whose state it uses.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import struct
import time
from pathlib import Path

from .. import protocol as P
from ..errors import ShmServeError, UnavailableError
from ..protocol import LAYOUT as L
from . import statistics
from .segments import ArenaLayout, create_sealed

log = logging.getLogger("shmserve.coordinator")
LEASE_QUARANTINE_S = 5.0  # a dead lease's id is not reused before in-flight work drains


class ControlPlane:
    # -- leases ----------------------------------------------------------------
    def open_lease(self, hello: P.Hello, peer_pid: int, peer_uid: int) -> P.HelloReply:
        if hello.version != P.PROTOCOL_VERSION:
            raise ShmServeError(f"protocol version {hello.version} not supported "
                                f"(server speaks {P.PROTOCOL_VERSION})", P.Status.INVALID_ARG)
        want = hello.arena_bytes or self.opts.default_arena_bytes
        if want <= 0 or want > self.opts.max_arena_bytes:
            raise ShmServeError(f"arena of {want} bytes refused: this server allows 1 to "
                                f"{self.opts.max_arena_bytes} bytes (--max-arena-bytes), or 0 "
                                f"for its default of {self.opts.default_arena_bytes} bytes",
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
        self.leases[client_id] = {"arena": arena, "pid": peer_pid, "uid": peer_uid,
                                  "layout": alayout}
        log.info("client connected: id %d, pid %d, uid %d (lease %d, %.1f MiB arena)", client_id,
                 peer_pid, peer_uid, generation, want / 2**20)
        return P.HelloReply(
            client_id=client_id, generation=generation, control_bytes=self.control.size,
            bell_bytes=self.bell.size,
            arena_bytes=alayout.segment_bytes, slots_offset=alayout.slots_offset,
            n_slots=alayout.n_slots, data_offset=alayout.data_offset, server_pid=os.getpid(),
            spin_us=self.opts.spin_us,
            models=[dataclasses.asdict(m) for m in self.model_list(broken=False)])

    def close_lease(self, client_id: int, reason: str) -> None:
        lease = self.leases.pop(client_id, None)
        if lease is None:
            return
        entry = self.layout.client(client_id)
        # SYNC POINT: pairs with the batcher's and workers' loads in ServerMaps.lease_of:
        # from here on they answer nothing of this lease and unmap its arena.
        self.server.ops.store32(entry + L["client_entry.state"], P.ClientState.DEAD)
        self.dead_since[client_id] = time.monotonic()
        lease["arena"].close()  # its memory goes when the last server mapping does
        # Let the batcher look: it unmaps the arena of an ended lease between batches.
        self.control.ops.ring_batcher(self.bell.ops)
        log.info("client disconnected: id %d, pid %d, uid %d: %s", client_id, lease["pid"],
                 lease["uid"], reason)

    # -- control-socket requests ------------------------------------------------
    def model_list(self, broken: bool = True) -> list[P.ModelMetadata]:
        """Every model version served; with `broken`, also each model whose config is
        broken (--exit-on-error=false), id -1, state "UNAVAILABLE: <reason>". The hello
        leaves those out: a client has no plan for them, so its request asks for the
        metadata and gets UnavailableError (find_model)."""
        rows = [self.metadata(e) for e in self.table.served()]
        problems = self.table.all_problems()
        if broken and problems:
            served = {(m.name, m.version) for m in rows}
            rows += [P.ModelMetadata(id=-1, name=p.name, version=p.version or 0, platform="",
                                     max_batch_size=0, inputs=[], outputs=[], state=p.state)
                     for p in problems if (p.name, p.version or 0) not in served]
            rows.sort(key=lambda m: (m.name, m.version))
        return rows

    def ready(self, rows: list[P.ModelMetadata]) -> bool:
        """Triton's server readiness, for a server that answers (it serves): with
        --strict-readiness (the default) every model version READY, broken ones
        included; without, ready as soon as it serves."""
        return not self.opts.strict_readiness or all(m.state == "READY" for m in rows)

    def metadata(self, entry) -> P.ModelMetadata:
        """A model version's metadata; its id is the entry's handle (models.py)."""
        return P.ModelMetadata(**entry.spec.metadata(entry.handle), state=entry.state)

    def find_model(self, name: str, version):
        """The table entry (models.Entry) a model name and version resolve to."""
        served = self.table.served()
        matches = [e for e in served if e.name == name]
        for p in self.table.problems.get(name, ()):  # broken: UNAVAILABLE, not unknown
            if (p.version is None and not matches) or p.version == version or (
                    not matches and version in (None, 0, -1)):
                raise UnavailableError(f"model '{name}'"
                                       + ("" if p.version is None else f" version {p.version}")
                                       + f" is {p.state}")
        if not matches:
            known = sorted({e.name for e in served})
            unloaded = (" was unloaded" if name in self.table.unloaded
                        else " is not loaded" if self.opts.model_control_mode == "explicit"
                        and (Path(self.opts.model_repository) / name).is_dir() else "")
            if unloaded:
                raise UnavailableError(f"model '{name}'{unloaded} (serving: "
                                       f"{', '.join(known) or 'none'})")
            raise ShmServeError(f"unknown model '{name}' (serving: {', '.join(known) or 'none'})",
                                P.Status.NOT_FOUND)
        if version in (None, 0, -1):
            return max(matches, key=lambda e: e.version)
        for e in matches:
            if e.version == int(version):
                return e
        raise ShmServeError(f"model '{name}' has no version {version} "
                            f"(available: {sorted(e.version for e in matches)})",
                            P.Status.NOT_FOUND)

    def statistics(self, name: str | None = None, version: int | None = None,
                   histograms: bool = False) -> list[dict]:
        """Triton's statistics extension (statistics.py): every model version, every
        version of `name`, or one version of it (an unknown one raises NOT_FOUND)."""
        if name is None:
            entries = self.table.served()
        elif version in (None, 0, -1):
            self.find_model(name, None)  # unknown or broken: say so
            entries = [e for e in self.table.served() if e.name == name]
        else:
            entries = [self.find_model(name, version)]
        return [self.model_statistics(e, histograms) for e in entries]

    def model_statistics(self, entry, histograms: bool = False) -> dict:
        spec, srv = entry.spec, self.server.ops
        instances = self.instance_rows(entry)
        memory = [{"type": "CPU", "id": i["instance"], "byte_size": i["rss_bytes"]}
                  for i in instances if i["rss_bytes"]]
        stat = statistics.model_statistics(
            spec.name, spec.version, entry.state,
            srv.model_stats(self.layout.model(entry.index)), memory, histograms)
        stat["shmserve"]["instances"] = instances
        return stat

    def client_rows(self) -> list[dict]:
        """Each connected client's slots in use and the tensor bytes its requests in
        flight name (read from its arena, which it writes: clamped, never trusted)."""
        rows = []
        ref, req = L["tensor_ref.size"], L["slot.request"]
        for client_id, lease in sorted(self.leases.items()):
            ops, layout = lease["arena"].ops, lease["layout"]
            used = nbytes = 0
            for i in range(layout.n_slots):
                slot = layout.slot(i)
                if ops.load32(slot + L["slot.state"]) == P.SlotState.FREE:
                    continue
                used += 1
                for count, first in (("n_inputs", "inputs"), ("n_outputs", "outputs")):
                    n = min(ops.load32(slot + req + L[f"request.{count}"]), P.MAX_TENSORS)
                    for k in range(n):
                        nbytes += ops.load64(slot + req + L[f"request.{first}"] + k * ref
                                             + L["tensor_ref.nbytes"])
            rows.append({"client": client_id, "pid": lease["pid"], "uid": lease.get("uid"),
                         "slots": layout.n_slots, "slots_in_use": used,
                         "arena_bytes": layout.segment_bytes,
                         "bytes_in_flight": min(nbytes, layout.segment_bytes)})
        return rows

    def server_status(self, histograms: bool = False) -> dict:
        """Everything the metrics endpoint and `shmserve status` show, in one read."""
        depth = capacity = 0  # over the live leases' submission rings
        for client_id, lease in list(self.leases.items()):
            ops = lease["arena"].ops
            if ops is None:
                continue
            enq = ops.load64(L["arena.enqueue_pos"])
            taken = self.server.ops.load64(self.layout.client(client_id) + L["client_entry.ring_pos"])
            ring = lease["layout"].ring_capacity
            depth += max(0, min(enq - taken, ring))
            capacity += ring
        batcher = next((c for c in self.children if c.role == "batcher"), None)
        return {"models": self.statistics(histograms=histograms),
                "broken": [{"name": p.name, "version": p.version, "state": p.state}
                           for p in self.table.all_problems()],
                "ring_depth": depth, "ring_capacity": capacity,
                "clients": self.client_rows(), "max_clients": self.opts.max_clients,
                "batcher": {"pid": batcher.proc.pid if batcher and batcher.proc else None,
                            "restarts": batcher.restarts if batcher else 0,
                            "wakeups": {w.name: self.server.ops.load64(
                                L["server.batcher_wakeups"] + 8 * w)
                                for w in (P.Wake.SPIN, P.Wake.SLEEP)}},
                "cpu_watch": {**self.cpu_watch.status(), "interval_ms": self.opts.cpu_watch_ms,
                              "colocate": self.opts.colocate_when_crowded,
                              **self.placement.status()},
                "uptime_s": time.monotonic() - self.started_at}

    def instance_rows(self, entry) -> list[dict]:
        """The model's instances as the supervisor and their mailboxes see them."""
        srv, rows = self.server.ops, []
        for n, child in enumerate(entry.workers):
            mb = self.layout.mailbox(child.boot["worker_index"])
            proc = child.proc
            pid = proc.pid if proc is not None and proc.poll() is None else None
            loaded = entry.state == "READY"
            state = ("RETIRED" if child.retired
                     else ("RESTARTING" if loaded else "UNAVAILABLE") if pid is None
                     else "BUSY" if srv.load32(mb + L["mailbox.state"]) != P.MailboxState.IDLE
                     else "IDLE" if loaded else "LOADING")
            rows.append({"instance": n, "pid": pid, "state": state, "restarts": child.restarts,
                         "executions": srv.load64(mb + L["mailbox.executions"]),
                         "wakeups": {w.name: srv.load64(mb + L["mailbox.wakeups"] + 8 * w)
                                     for w in (P.Wake.SPIN, P.Wake.SLEEP)},
                         "rss_bytes": _rss_bytes(pid)})
        return rows

    def handle(self, msg: P.Message, lease: dict) -> P.Message:
        if isinstance(msg, P.Hello):
            if lease.get("client_id") is not None:
                raise ShmServeError("hello sent twice on one connection", P.Status.INVALID_ARG)
            reply = self.open_lease(msg, lease["pid"], lease["uid"])
            lease["client_id"] = reply.client_id
            lease["send_fds"] = [self.leases[reply.client_id]["arena"].fd,
                                 self.control_readonly_fd, self.bell.fd]
            return reply
        if isinstance(msg, P.ListModels):
            rows = self.model_list()
            return P.ModelList([dataclasses.asdict(m) for m in rows], ready=self.ready(rows))
        if isinstance(msg, P.GetMetadata):
            return self.metadata(self.find_model(msg.model, msg.version))
        if isinstance(msg, P.GetConfig):
            return P.ModelConfig(self.find_model(msg.model, msg.version).spec.config_text)
        if isinstance(msg, P.LogSettings):
            return P.SettingsReply(self.settings.log(msg.update))
        if isinstance(msg, P.TraceSettings):
            if msg.model is not None:
                self.find_model(msg.model, None)  # unknown: NOT_FOUND
                if msg.update:
                    raise ShmServeError("per-model trace settings are not supported by "
                                        f"shmserve (model '{msg.model}'): change the global "
                                        "ones (/v2/trace/setting)", P.Status.INVALID_ARG)
            return P.SettingsReply(self.settings.trace_of(msg.update))
        if isinstance(msg, P.GetLabels):
            entry = self.find_model(msg.model, msg.version)
            spec = entry.spec
            return P.LabelsReply(entry.handle, {t.name: spec.labels(t.name) for t in spec.outputs
                                                if t.label_filename})
        if isinstance(msg, P.RepositoryIndex):
            return P.IndexReply(self.table.index(Path(self.opts.model_repository), msg.ready))
        if isinstance(msg, P.GetStats):
            return P.StatsReply(self.statistics(msg.model, msg.version, msg.histograms))
        if isinstance(msg, P.GetStatus):
            return P.StatusReply(self.server_status(histograms=True))
        if isinstance(msg, (P.ShmRegister, P.ShmStatus, P.ShmUnregister)):
            return self.system_shm.handle(msg)  # system_shm.py: the fronts' shared registry
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
        log.debug("control connection opened: pid %d, uid %d", pid, uid)
        reason = "the client closed its connection or exited"
        try:
            while True:
                try:
                    msg = P.decode_request(await P.read_frame(reader))
                    if isinstance(msg, P.LoadModel):  # these wait for workers: async
                        await self.load_op(msg.model, msg.config, msg.files)
                        reply = P.Done()
                    elif isinstance(msg, P.UnloadModel):
                        await self.unload_op(msg.model, msg.unload_dependents)
                        reply = P.Done()
                    else:
                        reply = self.handle(msg, lease)
                except ShmServeError as e:
                    reply = P.ErrorReply(int(e.code), e.msg, type(e).__name__)
                except P.UnknownOperation as e:
                    reply = P.ErrorReply(int(P.Status.INVALID_ARG), str(e), "ShmServeError")
                except (ValueError, TypeError, OverflowError, KeyError) as e:
                    reply = P.ErrorReply(int(P.Status.INVALID_ARG),
                                         f"malformed control message: {type(e).__name__}: {e}")
                fds = lease.pop("send_fds", None)
                if fds is None:
                    writer.write(P.pack_frame(reply))
                else:
                    await send_with_fds(writer, P.pack_frame(reply), fds)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        except ConnectionError as e:
            reason = f"connection lost ({e})"
        except asyncio.CancelledError:
            reason = "the server stopped"
        finally:
            if self.stopping:
                reason = "the server stopped"
            self.connections.discard(writer)
            if lease["client_id"] is not None:
                self.close_lease(lease["client_id"], reason)
            else:
                log.debug("control connection closed: pid %d, uid %d: %s", pid, uid, reason)
            writer.close()


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


def _rss_bytes(pid: int | None) -> int:
    """Resident memory of a live process (0 if it is gone)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
