"""Batcher process: one loop that takes requests in through intake (intake.py: the
trust boundary: ring, validation, sweep), keeps one scheduler per model
(scheduling/: dynamic batching or one request at a time) and hands the batches they
form to idle instance workers.

    python -m shmserve.server.batcher   (started by the coordinator; boot message on stdin)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from .._core import now_ns
from ..protocol import LAYOUT, MAILBOX_RETIRED, FailureReason, MailboxState, Status, Wake
from .intake import Intake
from .maps import ServerMaps, child_setup
from .models import DRAINED
from .repository import ModelSpec
from .scheduling import CoreQueue, Pending, Rejection, Scheduler, make_scheduler

L = LAYOUT
log = logging.getLogger("shmserve.batcher")
IDLE_CHECK_MS = 100  # an idle batcher checks its coordinator this often (--idle-check-ms)
RETIRED_CHECK_NS = 10_000_000  # look for retired instances' batches this often (they ring too)
# A sleep that ran its whole course although the doorbell moved meanwhile, or with a
# published entry waiting in a ring (BatcherCore.waiting; a claim still unpublished is
# none): a push did not wake us, which an honest client cannot cause (it rings whenever
# the token says we sleep). A client is moving bell.doorbell back, waiting on it to
# steal our wake-ups, or pushing without ringing;
# for WATCHFUL_NS after each such sleep, the batcher sleeps at most WATCHFUL_SLEEP_NS,
# so the other callers' requests wait that long for it instead of a whole idle check.
WATCHFUL_NS = 1_000_000_000
WATCHFUL_SLEEP_NS = 100_000
# The doorbell rung far more often than requests arrive and batches end (each push
# rings once, a worker going idle once): a client rings it for nothing, in a loop. For
# WATCHFUL_NS the batcher then stops listening to it and looks every WATCHFUL_SLEEP_NS,
# so that the rings cost it nothing (a FUTEX_WAKE needs no write access to stop).
NOISE_WINDOW_NS = 10_000_000
NOISE_RINGS = 200  # rings in a window beyond twice the entries and batches
STATE, PID = L["mailbox.state"], L["mailbox.pid"]
# Why BatcherCore.serve gave the loop back (csrc/batcher.c)
SERVE_DRAINED, SERVE_TIME, SERVE_IDLE, SERVE_LOST_RING = 1, 2, 3, 4
LOST_RING = ("a push did not wake the batcher (a client moves bell.doorbell back "
             "or pushes without ringing)")


def earliest(a: int | None, b: int | None) -> int | None:
    """The earlier of two deadlines; None is no deadline."""
    return b if a is None else a if b is None else min(a, b)


@dataclasses.dataclass
class Model:
    """One model as the batcher dispatches it."""
    model_id: int
    spec: ModelSpec
    workers: list[int]  # its instances' worker indexes
    scheduler: Scheduler
    offset: int  # its entry in the server segment (ServerLayout.model)
    handle: int  # the handle requests name it by (withdrawn while it drains)
    mailboxes: list[int]  # its instances' mailbox offsets, as workers
    pending: int = 0  # queue length last written to the model's statistics (-1: unknown)
    pinned: bool = False  # sequence batching: each batch is for one named instance
    draining: bool = False  # unloading: no new request; finish those queued, then go
    ticket: int = 0  # preserve_ordering: the last batch ticket handed out
    # Its policy sends a lone request at once: while its queue is empty, the C intake
    # hands such requests over itself (BatcherCore.set_direct, Batcher.direct).
    direct_ok: bool = False
    # Two batches deep (fill_next): a busy instance may hold its next batch; by
    # instance position, the requests we last saw in its next batch (None: none).
    overlap: bool = False
    next: list = dataclasses.field(default_factory=list)
    # Its queue is C's (scheduling/core_queue.py): the C core queues its requests and
    # hands its batches over (BatcherCore.set_queue, dispatch); m.next is unused.
    in_core: bool = False


class Batcher:
    def __init__(self, boot: dict):
        self.maps = ServerMaps(boot)
        self.idle_check_ns = int(boot.get("idle_check_ms", IDLE_CHECK_MS) * 1_000_000)
        self.max_queued_per_client = boot.get("max_queued_per_client", 0)  # the server's flag
        self.models: list[Model] = []
        # By model table index, shared with intake: None where no model is.
        self.schedulers: list[Scheduler | None] = [None] * self.maps.layout.n_models
        # By model table index, shared with intake: the C intake hands that model's lone
        # requests over itself (set_direct). Cleared as soon as one is queued, so that
        # nothing overtakes a queued request; set again when its queue is empty.
        self.direct: list[bool] = [False] * self.maps.layout.n_models
        self.intake = Intake(self.maps, self.schedulers, self.apply_table, self.direct)
        self.core = self.intake.core  # the per-request work in C, both ways (csrc/batcher.c)
        self.watchful_until = 0  # rings were lost until then: short sleeps (WATCHFUL_NS)
        self.deaf_until = 0  # rings were noise until then: timed sleeps only (NOISE_RINGS)
        self.defence_logged_at = 0
        self.handed = 0  # batches handed over by this loop, ever
        self.noise_window = (0, 0, 0, 0, 0)  # (start ns, doorbell, wake-ups, entries, batches)
        self.retired_check_at = 0
        # every mailbox's state: the loop spins only while no worker computes
        self.states = tuple(self.maps.layout.mailbox(w) + L["mailbox.state"]
                            for w in range(self.maps.layout.n_workers))
        for m in boot["models"]:
            self.add(m)
        # Changes of the model table (models.py), one JSON line each, numbered by the
        # epoch the coordinator stores in the server segment once the line is written.
        self.epoch = boot.get("table_epoch", 0)
        self.table = os.fdopen(boot["table_fd"], "r") if "table_fd" in boot else None
        self.draining = sum(m.draining for m in self.models)

    # -- the model table -----------------------------------------------------------------
    def apply_table(self) -> None:
        """Reads the table changes up to the epoch the coordinator announced."""
        target = self.maps.srv.load32(L["server.table_epoch"])
        while self.table is not None and self.epoch != target:
            line = self.table.readline()
            if not line:  # the coordinator is gone
                self.table = None
                return
            change = json.loads(line)
            self.epoch = change["epoch"]
            op = change["op"]
            if op == "add":
                self.add(change)
            elif op == "drain":
                self.intake.stale.update({int(h): m for h, m in change["stale"].items()})
                m = self.model(change["model_id"])
                if m is not None and not m.draining:
                    m.draining = True
                    self.draining += 1
                    self.set_direct(m, False)
            elif op == "drop":
                m = self.model(change["model_id"])
                if m is not None:
                    self.fail_queue(m)  # an unload that outlasted --exit-timeout-secs
                    self.remove(m)

    def add(self, d: dict) -> None:
        spec = ModelSpec.from_dict(d["spec"])
        scheduler = make_scheduler(spec)
        if spec.max_queued_per_client is None:  # the model leaves it to the server's flag
            scheduler.max_per_client = self.max_queued_per_client
        layout = self.maps.layout
        m = Model(d["model_id"], spec, list(d["workers"]), scheduler, layout.model(d["model_id"]),
                  d["handle"], [layout.mailbox(w) for w in d["workers"]], pinned=scheduler.pinned,
                  draining=d.get("draining", False))
        if spec.preserve_ordering:  # a restarted batcher goes on after its predecessor's
            srv, layout = self.maps.srv, self.maps.layout
            m.ticket = max([srv.load32(layout.model(m.model_id) + L["model.answer_turn"])]
                           + [srv.load64(layout.mailbox(w) + L["mailbox.ticket"]) & 0xFFFFFFFF
                              for w in m.workers])
        m.direct_ok = (scheduler.sends_lone_request_at_once() and not m.pinned
                       and not spec.preserve_ordering)
        m.overlap = spec.overlap and not m.pinned and not spec.preserve_ordering
        # a restarted batcher words the refusals of a draining model's withdrawn handle
        self.intake.stale.update({int(h): msg for h, msg in d.get("stale", {}).items()})
        m.next = [None] * len(m.workers)
        m.in_core = isinstance(scheduler, CoreQueue)
        if m.in_core:
            self.core.set_queue(m.model_id, scheduler.core_queue, m.mailboxes, m.offset, m.overlap)
        self.models.append(m)
        self.schedulers[m.model_id] = m.scheduler
        self.set_direct(m, m.direct_ok and not m.draining)

    def set_direct(self, m: Model, on: bool) -> None:
        """Whether the C intake hands m's lone requests over itself (see self.direct)."""
        self.direct[m.model_id] = on
        self.core.set_direct(m.model_id, m.mailboxes if on else None)

    def model(self, model_id: int) -> Model | None:
        return next((m for m in self.models if m.model_id == model_id), None)

    def remove(self, m: Model) -> None:
        self.models.remove(m)
        self.set_direct(m, False)
        if m.in_core:
            self.core.set_queue(m.model_id, None, (), 0, False)
        self.schedulers[m.model_id] = None
        if m.draining:
            self.draining -= 1

    def finish_drains(self) -> None:
        """An unloading model whose queue is empty and whose instances are idle is
        done: the coordinator, which waits for this, stops its workers."""
        srv, layout = self.maps.srv, self.maps.layout
        for m in [m for m in self.models if m.draining and not len(m.scheduler)]:
            busy = [layout.mailbox(w) for w in m.workers
                    if srv.load32(layout.mailbox(w) + L["mailbox.state"]) != MailboxState.IDLE]
            # SYNC POINT: as in dispatch(): a busy instance rings us when it goes idle.
            for mb in busy:
                srv.store32(mb + L["mailbox.batcher_waiting"], 1)
            if all(srv.load32(mb + L["mailbox.state"]) == MailboxState.IDLE for mb in busy):
                srv.set_pending(layout.model(m.model_id), 0)
                srv.store32(layout.model(m.model_id) + L["model.ready"], DRAINED)
                self.remove(m)

    # -- 3. hand batches to idle workers -------------------------------------------
    def dispatch(self) -> int | None:
        """Asks the scheduler of each model holding requests for batches and hands them
        to idle workers. Returns the earliest time (ns) at which the loop must run again
        without being rung: a scheduler's deadline (queue delay, queue timeout), or now
        when a worker went idle while we looked."""
        srv = self.maps.srv
        deadline = None
        now = now_ns()
        if now >= self.retired_check_at:
            self.fail_retired_batches()
            self.retired_check_at = now + RETIRED_CHECK_NS
        for m in self.models:
            s = m.scheduler
            if len(s) and not srv.load32(m.offset + L["model.ready"]):
                self.fail_queue(m)
            if not len(s):  # the common case between requests: nothing to look at
                if m.pending:
                    m.pending = 0
                    srv.set_pending(m.offset, 0)
                if m.direct_ok and not self.direct[m.model_id] and not m.draining:
                    self.set_direct(m, True)
                continue
            if m.in_core:  # the common case: its queue and batches are C's
                wait_until, handed = self.core.dispatch(m.model_id, now)
                self.handed += handed
                deadline = earliest(deadline, wait_until)
            else:
                deadline = earliest(deadline, self.dispatch_model(m, now))
            if len(s) != m.pending:  # nv_inference_pending_request_count
                m.pending = len(s)
                srv.set_pending(m.offset, m.pending)
            if not len(s) and m.direct_ok and not self.direct[m.model_id] and not m.draining:
                self.set_direct(m, True)
        if self.draining:
            self.finish_drains()
        return deadline

    def dispatch_model(self, m: Model, now: int) -> int | None:
        """dispatch() for a model whose queue is Python's (its scheduler's), which
        holds requests: returns its deadline."""
        srv, s = self.maps.srv, m.scheduler
        expired, expires = s.expire(now)
        if expired:
            s.left(r.pending for r in expired)
            for r in expired:
                self.intake.reject(m.model_id, r)
        deadline = expires
        busy, idle = [], []  # mailbox offsets; instance positions in m.workers
        for i, mb in enumerate(m.mailboxes):
            pid = srv.load32(mb + PID)
            if pid == MAILBOX_RETIRED:  # fail_retired_batches answers its batch
                continue
            if pid == 0 or srv.load32(mb + STATE) != MailboxState.IDLE:
                busy.append(mb)
            else:
                idle.append(i)
        waiting_for_more = False
        if len(s) and idle and m.pinned:  # sequences: a batch is for one instance
            plan, wait_until = s.assign(now, idle)
            for i, batch in plan:
                self.hand_over(m, i, batch)
                busy.append(m.mailboxes[i])
            deadline = earliest(deadline, wait_until)
        elif len(s) and idle:
            # One call for all idle instances, so that a policy can share the queue
            # among them (balanced batches) instead of filling the first.
            batches, wait_until = s.next_batches(now, len(idle))
            for i, batch in zip(idle, batches):
                self.hand_over(m, i, batch)
                busy.append(m.mailboxes[i])  # busy now: it must ring us when done
            if len(batches) < len(idle):
                deadline = earliest(deadline, wait_until)
                # An idle instance takes it by the deadline; with none, the policy
                # waits for an event, a worker going idle among them.
                waiting_for_more = wait_until is not None
        if m.overlap and len(s) and not waiting_for_more:
            # every live instance is busy now: give each its next batch
            deadline = earliest(deadline, self.fill_next(m, now))
        if len(s) and busy and not waiting_for_more:
            # Requests are left and every live instance is busy (some just got a
            # batch): each must ring the doorbell when it goes idle, or the rest
            # would wait for the idle tick.
            # SYNC POINT: pairs with the worker's store of IDLE then load of
            # batcher_waiting: either it rings us, or we see it idle here.
            for mb in busy:
                srv.store32(mb + L["mailbox.batcher_waiting"], 1)
            # an instance still starting (pid 0) rings us once it is up (worker.py)
            if any(srv.load32(mb + STATE) == MailboxState.IDLE and srv.load32(mb + PID)
                   for mb in busy):
                deadline = now
        return deadline

    def fill_next(self, m: Model, now: int) -> int | None:
        """Two batches deep: a busy instance's next batch waits in its mailbox and
        starts when the one it runs is done (shms_mailbox_finish), without waiting for
        us to wake. An instance without one gets what the policy would send now; one
        with one gets the requests that may join it (Scheduler.join), as Triton adds
        requests to a batch until it executes. Returns the policy's deadline when it
        holds requests back."""
        srv, s = self.maps.srv, m.scheduler
        free = []  # positions of instances running a batch, with no next batch
        for i, mb in enumerate(m.mailboxes):
            state = srv.load32(mb + STATE)
            if state == MailboxState.ASSIGNED_NEXT and m.next[i] is not None:
                extra = s.join(m.next[i], now) if len(s) else []
                if extra:
                    s.left(extra)
                    n, where = self.core.place(mb, m.offset, extra, True)
                    m.next[i] = (m.next[i] + extra if where == 2 else extra if where == 1
                                 else None)
                continue
            m.next[i] = None  # taken by its worker, or never there
            pid = srv.load32(mb + PID)
            if state == MailboxState.ASSIGNED and pid and pid != MAILBOX_RETIRED:
                free.append(i)
        if not free or not len(s):
            return None
        batches, wait_until = s.next_batches(now, len(free))
        for i, batch in zip(free, batches):
            s.left(batch)
            n, where = self.core.place(m.mailboxes[i], m.offset, batch, False)
            m.next[i] = batch if where == 1 else None
        return wait_until if len(batches) < len(free) else None

    def fail_retired_batches(self) -> None:
        """Answers the batch a retired (crash-looped) instance left in its mailbox: it
        has nobody else to answer it. The coordinator rings us when it retires one."""
        srv = self.maps.srv
        for m in self.models:
            for w, mb in zip(m.workers, m.mailboxes):
                # its batch, then the next batch waiting behind it (two batches deep)
                while (srv.load32(mb + PID) == MAILBOX_RETIRED
                       and srv.load32(mb + STATE) != MailboxState.IDLE):
                    if srv.load32(mb + STATE) == MailboxState.PROMOTING:
                        srv.mailbox_finish(mb)  # it died moving the next batch in place
                    self.maps.fail_batch(w, m.model_id, f"model '{m.spec.name}': the instance "
                                         "executing this request crash-looped and was retired")

    def fail_queue(self, m: Model) -> None:
        """The model became UNAVAILABLE (its instances crash-looped): answer its queue."""
        drained = m.scheduler.drain()
        m.scheduler.left(drained)
        for p in drained:
            self.intake.reject(m.model_id, Rejection(
                p, Status.UNAVAILABLE, f"model '{m.spec.name}' is not available ("
                + ("it was unloaded" if m.draining else "its workers crash-looped; see "
                   "`shmserve models`") + ")", FailureReason.BACKEND))

    def hand_over(self, q: Model, instance: int, batch: list[Pending]) -> None:
        """Gives a batch to the instance at position `instance` of q.workers."""
        q.scheduler.left(batch)
        mb = q.mailboxes[instance]
        if q.overlap:
            q.next[instance] = None
        if q.pinned or q.spec.preserve_ordering:
            # A request whose lease ended while queued has no arena any more (unmapped).
            batch = [p for p in batch if p.arena.ops is not None]
            if not batch:
                return
        if q.pinned:  # the worker keeps each sequence's state by its batch slot
            srv, layout = self.maps.srv, self.maps.layout
            for p in batch:
                srv.store32(layout.shadow_at(p.shadow) + L["shadow.sequence_slot"], p.sequence_slot + 1)
        if q.spec.preserve_ordering:  # the worker answers after the batches handed out before
            q.ticket = q.ticket % 0xFFFFFFFF + 1  # 1 .. 2^32-1: 0 means unordered
            self.maps.srv.store64(mb + L["mailbox.ticket"], q.ticket)
        # Stamps, queue times and the assignment in one C call, which leaves out the
        # requests whose lease ended while queued.
        # SYNC POINT (in shms_mailbox_assign): the store of ASSIGNED pairs with the
        # worker's doorbell_wait on its mailbox state; the ticket is stored before it.
        self.core.hand_over(mb, q.offset, batch)
        self.handed += 1

    # -- the loop ------------------------------------------------------------------
    def serve_forever(self) -> None:
        ctl, bell_ops, intake = self.maps.ctl, self.maps.bell_ops, self.intake
        bell, sleeping = L["bell.doorbell"], L["control.batcher_sleeping"]
        spin = self.maps.spin
        states = self.states
        srv, epoch = self.maps.srv, L["server.table_epoch"]
        while True:
            seen = bell_ops.load32(bell)
            # 0. models added or withdrawn while serving (one load when none was)
            if srv.load32(epoch) != self.epoch:
                self.apply_table()
            # 1. take every published request from the rings, into its model's scheduler
            intake.drain_ring()
            # 2. now and then (at once after ring damage): requests the rings lost
            intake.housekeeping()
            # 3. hand batches to idle workers
            deadline = self.dispatch()
            # come back when a stalled claim's grace ends
            deadline = earliest(deadline, intake.stall_ends())
            deadline = earliest(deadline, intake.next_sweep())  # while the ring is damaged
            # 4. sleep until rung, or until the deadline
            now = now_ns()
            timeout = self.idle_check_ns if deadline is None else max(0, deadline - now)
            if self.all_in_c(now):  # the common case: passes in C until one is ours
                if not self.serve_in_c(seen, deadline):
                    return
                continue
            watchful = now < self.watchful_until
            if watchful:
                timeout = min(timeout, WATCHFUL_SLEEP_NS)
            # Spin only while no worker computes: then the next event is a new request
            # we want to catch at once; under load the CPU is better left to the workers.
            busy = any(self.maps.srv.load32(off) for off in states)
            deaf = now < self.deaf_until
            if deaf:  # rung for nothing: look on our own clock
                time.sleep(min(timeout, WATCHFUL_SLEEP_NS) / 1e9)
                woke = Wake.TIMEOUT
            else:
                # SYNC POINT: clients (ring_push + doorbell_ring) and workers (idle)
                # ring us. The spin policy (shms_spin_wait) decides and learns from this
                # wait; sole: we are the doorbell's one sleeper, our token in the
                # control block (which clients map read-only).
                woke = bell_ops.doorbell_wait(bell, sleeping, seen, 0 if busy else spin,
                                              timeout, True, ctl)
            if woke or deaf:
                self.watch_noise(bell_ops.load32(bell))
            if woke:
                self.maps.count_wake(L["server.batcher_wakeups"], woke)
                # a short deadline's sleep may end with a push by chance: not evidence
                if woke == Wake.SLEEP and (watchful or timeout >= 1_000_000) \
                        and now_ns() - now >= timeout:
                    self.watchful_until = self.defend(self.watchful_until, LOST_RING)
            elif not deaf and (watchful or timeout >= 1_000_000) \
                    and self.core.waiting(self.maps.arenas):
                # a whole sleep with pushes waiting: their rings' moves were undone
                self.watchful_until = self.defend(self.watchful_until, LOST_RING)
            elif deadline is None and not self.maps.parent_alive():
                return

    def all_in_c(self, now: int) -> bool:
        """Whether the loop may run in C (BatcherCore.serve): no request is in a
        Python queue, and nothing of Python's is on (a defence, a stalled claim at the
        ring head, ring damage, a model unloading)."""
        intake = self.intake
        return (now >= self.watchful_until and now >= self.deaf_until and not intake.stalls
                and not intake.revisit_at
                and now >= intake.damaged_until and not self.draining
                and not any(len(m.scheduler) for m in self.models if not m.in_core))

    def serve_in_c(self, seen: int, deadline: int | None) -> bool:
        """Passes in C (BatcherCore.serve) from this pass's doorbell value and
        deadline, until something is Python's: requests or stops its drain left (the
        next pass's drain_ring finishes them), our timers (the sweep; once rung,
        retired instances and the doorbell's noise window), a lost ring, the idle
        check, a model table change or ring damage. Returns
        False when the coordinator is gone."""
        intake = self.intake
        self.watch_noise(self.maps.bell_ops.load32(L["bell.doorbell"]))  # a fresh window
        # the sweep is due even on a quiet server; the others only matter once rung
        woken_until = min(self.retired_check_at, self.noise_window[0] + NOISE_WINDOW_NS)
        (intake.rotor, why, items, stop, handed, consumed, start, left) = self.core.serve(
            intake.rotor, self.maps.arenas, seen, deadline, intake.sweep_at, woken_until,
            self.epoch, self.maps.spin, self.idle_check_ns, self.states)
        intake.rotor %= self.maps.layout.max_clients
        intake.consumed += consumed
        self.handed += handed
        for m in self.models:  # C wrote their pending counts: the next dispatch writes ours
            if m.in_core:
                m.pending = -1
        if why == SERVE_DRAINED:
            intake.carried = (items, stop, start, left)
        elif why == SERVE_LOST_RING:
            self.watchful_until = self.defend(self.watchful_until, LOST_RING)
        elif why == SERVE_IDLE:
            return self.maps.parent_alive()
        return True

    def watch_noise(self, bell: int) -> None:
        """Counts the doorbell's rings and our wake-ups against the ring entries taken
        and the batches handed over, per NOISE_WINDOW_NS; far more than those, or a bell
        moved back (it only moves forward: a client undoes others' rings): deaf for
        WATCHFUL_NS (re-armed while it goes on)."""
        now = now_ns()
        start, bell0, wakes0, entries0, batches0 = self.noise_window
        if now - start < NOISE_WINDOW_NS:
            return
        srv, counters = self.maps.srv, L["server.batcher_wakeups"]
        wakes = sum(srv.load64(counters + 8 * w) for w in (Wake.SPIN, Wake.SLEEP))
        self.noise_window = (now, bell, wakes, self.intake.consumed, self.handed)
        if not start:
            return
        moves = (bell - bell0) & 0xFFFFFFFF
        work = (self.intake.consumed - entries0) + (self.handed - batches0)
        if moves >= 1 << 31:
            what = "moved back (a client undoes the others' rings)"
        elif moves + (wakes - wakes0) > 3 * work + NOISE_RINGS:
            what = (f"rung {moves} times, {wakes - wakes0} wake-ups, in "
                    f"{(now - start) // 1_000_000} ms for {work} requests and batches (a client "
                    "rings it in a loop)")
        else:
            return
        self.deaf_until = self.defend(self.deaf_until, f"bell.doorbell: {what}; the batcher "
                                      "stops listening to it")

    def defend(self, until: int, what: str) -> int:
        """A client breaks the doorbell's rules: returns when the defence (a look every
        WATCHFUL_SLEEP_NS) ends, WATCHFUL_NS from now; says so when it starts, once a
        second at most."""
        now = now_ns()
        if now >= until and now - self.defence_logged_at >= WATCHFUL_NS:
            log.warning("%s; it looks every %d us until that stops", what,
                        WATCHFUL_SLEEP_NS // 1000)
            self.defence_logged_at = now
        return now + WATCHFUL_NS

def main() -> None:
    boot = child_setup("batcher")
    batcher = Batcher(boot)
    log.debug("batcher serving: %d model%s, %d worker%s", len(batcher.models),
              "s" * (len(batcher.models) != 1), batcher.maps.layout.n_workers,
              "s" * (batcher.maps.layout.n_workers != 1))
    # 0. requests a previous batcher held (those it accepted for an unloading model too)
    batcher.intake.recover({m.model_id: m.handle for m in batcher.models if m.draining})
    batcher.serve_forever()


if __name__ == "__main__":
    main()
