"""What the batcher and the workers map: the control and server segments, and the
arenas of the clients whose requests they handle (opened lazily, dropped when the
lease ends)."""
from __future__ import annotations

import logging
import os
import sys

from .. import _core
from ..logs import LogOptions, setup as setup_logging
from ..protocol import LAYOUT, ClientState, MailboxState, Status
from ..segments import Segment
from .segments import ArenaLayout, ServerLayout
from .._core import AdaptiveSpin

L = LAYOUT
log = logging.getLogger("shmserve.maps")


def _after(a: int, b: int) -> bool:
    """Ticket a comes after ticket b (32-bit tickets that wrap)."""
    return 0 < (a - b) & 0xFFFFFFFF < 1 << 31


class ServerMaps:
    def __init__(self, boot: dict):
        self.layout = ServerLayout(boot["max_clients"], boot["slots_per_client"],
                                   boot["n_models"], boot["n_workers"])
        # Inherited from the coordinator (memfds without names): mapped, then closed.
        self.control = Segment.from_fd(boot["control_fd"], boot["control_bytes"], "control segment")
        os.close(boot["control_fd"])
        self.bell = Segment.from_fd(boot["bell_fd"], boot["bell_bytes"], "bell segment")
        os.close(boot["bell_fd"])
        self.server = Segment.from_fd(boot["server_fd"], self.layout.size, "server segment")
        os.close(boot["server_fd"])
        self.server.ops.check_header("server")
        self.ctl = self.control.ops
        self.bell_ops = self.bell.ops
        self.srv = self.server.ops
        self.spin = AdaptiveSpin(int(boot["spin_us"] * 1000), int(boot["max_spin_us"] * 1000))
        self.spin.watch(self.ctl, L["control.crowded"])  # the coordinator's cpu_watch
        self.coordinator_pid = boot["coordinator_pid"]
        # {client_id: (lease, Segment, ArenaLayout)}; (lease, None, None): that live
        # lease's arena cannot be mapped (its header is not its own): not tried again
        self.arenas: dict[int, tuple[int, Segment | None, ArenaLayout | None]] = {}
        # {client_id: (lease, Mapping)} of arenas, as _core.Batch.begin looks them up
        self.mapped: dict[int, tuple[int, _core.Mapping]] = {}
        self._retired: list[Segment] = []  # mappings of ended leases, closed between batches
        self.pinning = None  # a GPU worker's gpu.ipc.HostPinning: arenas page-locked

    # The client table is written by the coordinator only; clients never see it.
    def lease_of(self, client_id: int) -> tuple[int, int]:
        """(state, lease generation) of a client table entry.
        SYNC POINT: the seq_cst load of the state pairs with the coordinator's store of
        ALIVE after the entry's other fields (write_client_entry) and of DEAD (close_lease)."""
        off = self.layout.client(client_id)
        return (self.srv.load32(off + L["client_entry.state"]),
                self.srv.load32(off + L["client_entry.generation"]))

    def arena(self, client_id: int, lease: int):
        """(Segment, ArenaLayout) of a live lease, or None if it ended or never was.
        Never unmaps anything: a request of a batch or a queue may still hold the
        mapping of a lease that just ended; drop_ended_leases does it between batches."""
        if client_id >= self.layout.max_clients:
            return None
        state, current = self.lease_of(client_id)
        if state != ClientState.ALIVE or current != lease:
            return None
        cached = self.arenas.get(client_id)
        if cached and cached[0] == lease:
            return None if cached[1] is None else (cached[1], cached[2])
        if cached:  # an older lease of this client id: unmapped by drop_ended_leases
            old = self.arenas.pop(client_id)[1]
            if old is not None:
                self._retired.append(old)
            self.mapped.pop(client_id, None)
        # /proc/<coordinator>/fd/<memfd>: the coordinator's descriptor of the arena
        _, _, size, path = self.srv.read_client_entry(self.layout.client(client_id))
        try:
            seg = Segment.open_path(path, size)
        except (OSError, ValueError) as e:
            if self.lease_of(client_id) == (ClientState.ALIVE, lease):  # not just ended
                log.warning("client %d: cannot map its arena %s: %s", client_id, path, e)
            return None
        # The descriptor number may have been reused by a newer lease's arena since we
        # read the table: the header, written by the coordinator, says whose it is.
        try:
            seg.ops.check_header("arena")
            owner = (seg.ops.load32(L["arena.client_id"]), seg.ops.load32(L["arena.generation"]))
        except ValueError:
            owner = None
        if owner != (client_id, lease) or self.lease_of(client_id) != (ClientState.ALIVE, lease):
            seg.close()
            if self.lease_of(client_id) == (ClientState.ALIVE, lease):
                # the lease lived throughout, so the descriptor was its arena's: its own
                # client wrote over the header. Nothing of this lease is served, and the
                # batcher does not reopen the arena at every pass
                log.warning("client %d: its arena's header is not an arena's; its requests "
                            "are not served", client_id)
                self.arenas[client_id] = (lease, None, None)
            return None
        layout = ArenaLayout(self.layout.slots_per_client, size)
        if self.pinning is not None:
            self.pin(seg, client_id)
        self.arenas[client_id] = (lease, seg, layout)
        self.mapped[client_id] = (lease, seg.ops)
        return seg, layout

    def drop_ended_leases(self) -> None:
        """Unmaps the arenas of leases that ended: an arena's memory is freed only when
        its last mapping goes, and a client id may not come back for a long time. Call
        it only where no request in hand uses a mapping (between batches); a queued
        request whose arena went is dropped unanswered (nobody is left to answer)."""
        for client_id, (lease, seg, _) in list(self.arenas.items()):
            if self.lease_of(client_id) != (ClientState.ALIVE, lease):
                del self.arenas[client_id]
                self.mapped.pop(client_id, None)
                if seg is not None:
                    self._retired.append(seg)
        while self._retired:
            seg = self._retired.pop()
            if self.pinning is not None:
                self.pinning.unregister(seg)
            seg.close()

    def pin(self, seg: Segment, client_id: int) -> None:
        """Page-locks a caller's arena for the GPU; a failure costs speed, not service."""
        try:
            self.pinning.register(seg)
        except Exception as e:  # e.g. RLIMIT_MEMLOCK: copies go through pageable memory
            log.warning("client %d: its arena stays pageable (cannot page-lock it for the "
                        "GPU: %s)", client_id, e)

    def live_leases(self) -> set:
        return {(client_id, lease) for client_id, (lease, seg, _) in self.arenas.items()
                if seg is not None}

    def fail_batch(self, worker: int, model_id: int, message: str) -> int:
        """Answers every request of the batch in a mailbox whose worker died with it
        (UNAVAILABLE), and ends that batch: the mailbox goes IDLE, or the next batch
        waiting there becomes its batch (shms_mailbox_finish). Returns how many were
        answered."""
        srv, mb = self.srv, self.layout.mailbox(worker)
        if srv.load32(mb + L["mailbox.state"]) in (MailboxState.IDLE, MailboxState.PROMOTING):
            return 0  # no batch, or one done and answered (the next moves in: finish)
        answered = []
        for index in srv.mailbox_batch(mb):
            shadow = self.layout.shadow_at(index)
            client_id, slot, generation, lease, _, _, _, taken_ns, *_ = srv.read_shadow(shadow)
            mapped = self.arena(client_id, lease)
            if mapped is not None:
                arena, layout = mapped
                if arena.ops.complete(layout.slot(slot), generation, int(Status.UNAVAILABLE),
                                      message, []):
                    answered.append((int(Status.UNAVAILABLE), taken_ns))
        self.record_answers(model_id, answered)  # after: only those answered count
        ticket = srv.load64(mb + L["mailbox.ticket"]) & 0xFFFFFFFF
        if ticket:  # preserve_ordering: its turn is over, answered or not
            self.end_answer_turn(model_id, ticket)
        # SYNC POINT (in shms_mailbox_finish): pairs with the batcher's loads of the
        # mailbox state in dispatch(): only then may it hand this mailbox a new batch.
        srv.mailbox_finish(mb)
        return len(answered)

    # -- preserve_ordering: a model's batches answer in the order they were handed out --
    def wait_answer_turn(self, model_id: int, ticket: int, siblings: list[int], own: int) -> None:
        """Blocks until every batch of the model handed out before `ticket` (the batch
        in mailbox `own`) has answered, or is held by none of its instances' mailboxes
        (`siblings`) any more: a batch whose worker died is answered out of turn by
        fail_batch, and nobody waits for it."""
        srv = self.srv
        turn_off = self.layout.model(model_id) + L["model.answer_turn"]
        state, mb_ticket = L["mailbox.state"], L["mailbox.ticket"]
        while True:
            turn = srv.load32(turn_off)
            if not _after(ticket, (turn + 1) & 0xFFFFFFFF):
                return
            if not any(mb != own and srv.load32(mb + state) != MailboxState.IDLE
                       and _after(ticket, srv.load64(mb + mb_ticket) & 0xFFFFFFFF)
                       for mb in siblings):
                return
            # SYNC POINT: woken by end_answer_turn's store + wake; the slice re-checks
            # the siblings (one that died holds no ticket any more).
            srv.doorbell_wait(turn_off, own + L["mailbox.order_waiting"], turn, 0, 10_000_000)

    def end_answer_turn(self, model_id: int, ticket: int) -> None:
        """The batch of `ticket` has answered: the next may."""
        srv = self.srv
        turn_off = self.layout.model(model_id) + L["model.answer_turn"]
        while True:
            turn = srv.load32(turn_off)
            if not _after(ticket, turn) or srv.cas32(turn_off, turn, ticket):
                break
        srv.wake(turn_off)

    def ring_batcher(self) -> None:
        self.ctl.ring_batcher(self.bell_ops)

    def record_answers(self, model_id: int, answers: list, reason: int = -1) -> None:
        """Statistics of requests answered now: [(status, taken_ns)], a failure under
        `reason` (a FailureReason) if given, else the reason of its status."""
        self.srv.record_answers(self.layout.model(model_id), answers, reason)

    def count_wake(self, counters_off: int, how: int) -> None:
        """A server process woke (Wake.SPIN or SLEEP): shmserve_wakeups_total."""
        if how:
            self.srv.add64(counters_off + 8 * how, 1)

    def parent_alive(self) -> bool:
        return os.getppid() == self.coordinator_pid


def child_setup(role: str) -> dict:
    """Common start of a child process: read its boot message from stdin, die with
    the coordinator, log as the coordinator was told to (shmserve/logs.py)."""
    import json
    import signal

    _core.set_parent_death_signal(signal.SIGKILL)
    _core.set_timer_slack(1000)  # max_queue_delay deadlines are tens of microseconds
    boot = json.loads(sys.stdin.readline())
    if os.getppid() != boot["coordinator_pid"]:  # the coordinator died before prctl
        sys.exit(1)
    sys.stdin.close()
    setup_logging(LogOptions.from_dict(boot["log"]), role)
    if "settings" in boot:  # the logging and trace extensions' changes (settings.py)
        from .settings import start_watching

        start_watching(boot["settings"])
    return boot
