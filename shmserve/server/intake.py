"""Intake: the batcher's trust boundary. Everything a client wrote is read here and
nowhere else in the batcher: the submission rings in the clients' arenas (drained in
turn, a stalled claim or damaged head skipped), each request's descriptor (copied and
validated in C: on the common path by BatcherCore.drain, one call per pass for every
request published; else take()), the slot states of live leases (swept for requests
the rings lost, and after a restart for those the previous batcher held).

What comes out is a validated queue entry (scheduling.Pending), handed to the
scheduler of its model; intake answers itself every request refused before it reaches
a worker: invalid ones, and the Rejections of a scheduler (reject()).
"""
from __future__ import annotations

import array
import dataclasses
import logging
from typing import Sequence

from .._core import BatcherCore, now_ns
from ..protocol import (LAYOUT, POP_CORRUPT, POP_OK, POP_STALLED, STALE_MODEL_ID, ClientState,
                        FailureReason, MailboxState, RingConsumer, SlotState, Status, Timestamp,
                        clip_error, decode_parameters, decode_sequence_id)
from .maps import ServerMaps
from .scheduling import Pending, Rejection, Scheduler, SequencePending

L = LAYOUT
ENQUEUE_STAMP = L["slot.t_ns"] + 8 * Timestamp.ENQUEUE  # the client's push time, in a slot
log = logging.getLogger("shmserve.batcher")
RING_STALL_NS = 20_000_000  # a live client's unpublished ring claim is skipped after this
# (it stalls only that client's ring: the others are drained meanwhile)
SWEEP_NS = 1_000_000_000  # look for SUBMITTED requests the rings lost this often
# ... and in a damaged ring's arena, for SWEEP_NS after the damage, this often, for
# requests at least this old: a client whose threads race a vandal of its own (or
# whose ring a bug damaged) would otherwise wait SWEEP_NS / 10 for each lost entry.
DAMAGED_SWEEP_NS = 1_000_000
RING_REVISIT_NS = 100_000  # a ring given up on for a pass (the tries bound) is looked at again
SEQUENCE_FLAGS = L["REQUEST_SEQUENCE_START"] | L["REQUEST_SEQUENCE_END"]  # STREAM is not one
NO_OPTIONS = (0, 0, 0, 0, 0, 0, False)  # a request's options when it sets none
STOP_POP, STOP_MAP, STOP_INVALID, STOP_RING = 0, 1, 2, 3  # why BatcherCore.drain stopped
# (csrc/batcher.c)


class Intake:
    def __init__(self, maps: ServerMaps, schedulers: Sequence[Scheduler | None],
                 table_changed=lambda: None, direct: list[bool] | None = None):
        self.maps = maps
        self.schedulers = schedulers  # by model table index; None: no model there
        # By model table index: whether BatcherCore.drain hands its lone requests over
        # (the batcher's set_direct); cleared here when one of its requests is queued.
        self.direct = direct if direct is not None else [False] * maps.layout.n_models
        self.table_changed = table_changed  # reads the table changes announced (batcher)
        # Handles withdrawn (unload, reload) -> the error their requests get (models.py)
        self.stale: dict[int, str] = {}
        self.n_models = maps.layout.n_models
        self.core = BatcherCore(maps.ctl, maps.bell_ops, maps.srv, Pending)
        self.rotor = 0  # the ring each pass begins with: one further each pass (fairness)
        # client id -> (ring position, since ns) of a claimed, unpublished head
        self.stalls: dict[int, tuple[int, int]] = {}
        self.revisit_at = 0  # a ring left with entries (the tries bound): come back then
        self.sweep_at = self.full_sweep_at = now_ns() + SWEEP_NS
        self.leases_dropped_at = now_ns()
        self.damaged: dict[int, int] = {}  # client id -> its ring damaged until: quick sweeps
        self.damage_logged_at = self.lost_logged_at = 0
        self.consumed = 0  # ring entries taken, ever: one ring of the doorbell each
        # (items, stop, start, left) of a drain BatcherCore.serve did, for drain_ring
        self.carried: tuple | None = None

    # -- take every published request from the rings -----------------------------
    @property
    def damaged_until(self) -> int:
        return max(self.damaged.values(), default=0)

    def ring_of(self, client_id: int) -> RingConsumer | None:
        """The submission ring of a live lease whose arena is mapped (mapping it)."""
        state, lease = self.maps.lease_of(client_id)
        mapped = self.maps.arena(client_id, lease) if state == ClientState.ALIVE else None
        if mapped is None:
            return None
        return self.ring_in(client_id, *mapped)

    def ring_in(self, client_id: int, arena, alayout) -> RingConsumer:
        return RingConsumer(arena.ops, alayout.ring_offset, alayout.ring_capacity, self.maps.srv,
                            self.maps.layout.client(client_id) + L["client_entry.ring_pos"])

    def _drain(self, start: int, left: int) -> tuple:
        """One BatcherCore.drain of `left` rings from `start` on: (items, stop, the
        ring it stopped at, the rings left from there)."""
        n = self.maps.layout.max_clients
        visited, items, stop, consumed = self.core.drain(start % n, left, self.maps.arenas)
        self.consumed += consumed
        return items, stop, start + visited, left - visited

    def drain_ring(self) -> bool:
        """Takes every published request of every live lease's ring, one ring after
        another from self.rotor on: the common path in one C call per pass
        (BatcherCore.drain), the rest here. A ring that stalls or is damaged holds up
        only its own client: the others are drained first. Returns whether any
        request was taken."""
        n = self.maps.layout.max_clients
        took, fresh, stalled = False, False, set()
        self.revisit_at = 0
        if self.carried is not None:  # what BatcherCore.serve's drain left us
            (items, stop, start, left), self.carried = self.carried, None
        else:
            start, self.rotor = self.rotor, (self.rotor + 1) % n
            items, stop, start, left = self._drain(start, n)
            fresh = True
        tries, tried_at = 0, None
        while True:
            if items:
                took = True
                for model_id, p, extra in items:
                    self.queue(model_id, p, extra)
            if stop is None or left <= 0:
                if not fresh:
                    # SYNC POINT: that drain was before this pass loaded the doorbell's
                    # value: what was pushed in between rang before it. Drain again.
                    start, self.rotor = self.rotor, (self.rotor + 1) % n
                    items, stop, start, left = self._drain(start, n)
                    fresh = True
                    continue
                break
            client_id, advance = stop[1], False
            # Bounded per ring (failed skips included), so that a client rewriting its
            # cells as fast as we skip them cannot keep the batcher on its ring.
            tries = tries + 1 if tried_at == start else 1
            tried_at = start
            if stop[0] == STOP_INVALID:
                took = True
                self.answer_invalid(*stop[1:])
            elif stop[0] == STOP_MAP:  # a live lease whose arena is not mapped here yet
                advance = self.ring_of(client_id) is None  # ended meanwhile
            elif stop[0] == STOP_RING:
                ring = self.ring_of(client_id)
                if ring is not None and ring.repair():
                    self.ring_damaged(client_id, "enqueue_pos was outside its ring; moved back")
            else:  # the ring's head: a stalled claim or damage
                _, _, kind, head_seq = stop
                ring = self.ring_of(client_id)
                if ring is None:
                    advance = True
                elif kind == POP_STALLED and not self.may_skip_claim(client_id, ring):
                    stalled.add(client_id)
                    advance = True
                elif ring.skip(head_seq):
                    # A cell left consumed is what a predecessor that died between popping
                    # and saving its ring position leaves: not damage.
                    if kind == POP_CORRUPT and head_seq != ring.pos - 1 + ring.capacity:
                        self.ring_damaged(client_id, f"ring cell at position {ring.pos - 1} "
                                          f"held {head_seq:#x}")
            if not advance and tries > 2 * self.maps.layout.slots_per_client + 2:
                self.revisit_at = now_ns() + RING_REVISIT_NS  # its entries: the next pass
                advance = True
            if advance:
                start, left, tries = start + 1, left - 1, 0
            items, stop, start, left = self._drain(start, left) if left > 0 else ([], None, start, 0)
            fresh = True
        for client_id in list(self.stalls):  # stalls that ended (published, or skipped)
            if client_id not in stalled:
                del self.stalls[client_id]
        return took

    def take(self, client_id: int, slot: int, gen: int, honoured: bytes | None = None) -> None:
        """Claims, copies and validates one request whose arena may need mapping first
        (the path drain()'s C call leaves here; also the sweep's and recovery's); answers
        it at once if invalid, else hands it to its model's scheduler. honoured: the
        withdrawn handles still accepted, by model index (recover())."""
        layout = self.maps.layout
        if client_id >= layout.max_clients or slot >= layout.slots_per_client:
            return  # malformed entry: there is no slot to answer
        _, lease = self.maps.lease_of(client_id)
        mapped = self.maps.arena(client_id, lease)
        if mapped is None:
            return  # the lease ended: nobody to answer
        arena, alayout = mapped
        slot_off = alayout.slot(slot)
        try:
            taken = arena.ops.take(slot_off, slot, gen, client_id, lease, self.maps.srv,
                                   layout.shadow(client_id, slot), layout.models_offset,
                                   self.n_models, alayout.data_offset, honoured)
        except (IndexError, ValueError) as e:  # arena header destroyed by its owner
            log.warning("client %d: unusable request descriptor: %s", client_id, e)
            return
        if taken is None:
            return  # stale or duplicate entry
        if isinstance(taken[1], str):
            self.answer_invalid(client_id, slot, gen, *taken, lease)
            return
        (model_id, rows, key, priority, timeout_us, params_off, params_bytes, flags, sequence_id,
         sid_off, sid_bytes) = taken
        p = Pending(layout.shadow_index(client_id, slot), rows, key, now_ns(), arena, slot_off, gen,
                    priority, timeout_us, client=client_id)
        # A request pushed once the server began to stop is refused; earlier ones drain.
        # The ENQUEUE stamp is the client's word: a client can only win its own request
        # a place in the drain, which --exit-timeout-secs bounds anyway.
        # SYNC POINT: pairs with the coordinator's store of drain_since_ns (drain()).
        drain_since = self.maps.srv.load64(L["server.drain_since_ns"])
        late = bool(drain_since) and arena.ops.load64(slot_off + ENQUEUE_STAMP) >= drain_since
        self.queue(model_id, p, (params_off, params_bytes, flags, sequence_id, sid_off,
                                 sid_bytes, late))

    def answer_invalid(self, client_id: int, slot: int, gen: int, status: int, msg: str,
                       lease: int) -> None:
        """Answers a request claimed and refused (take(), BatcherCore.drain)."""
        layout = self.maps.layout
        # The model id of the server's copy: the slot's own the client may rewrite.
        model_id = self.maps.srv.load32(layout.shadow(client_id, slot) + L["shadow.request"]
                                        + L["request.model_id"])
        if msg.startswith(STALE_MODEL_ID):  # an unloaded or reloaded model's handle
            self.table_changed()
            msg = self.stale.get(model_id, msg)
        elif model_id < self.n_models:  # statistics first: the caller may read them next
            self.maps.record_answers(model_id, [(status, now_ns())])
        mapped = self.maps.arena(client_id, lease)
        if mapped is not None:
            arena, alayout = mapped
            arena.ops.complete(alayout.slot(slot), gen, status, msg, [])

    def queue(self, model_id: int, p: Pending, extra: tuple | None) -> None:
        """Hands a valid request to its model's scheduler. extra: None on the common
        path, else (parameters_offset, parameters_bytes, flags, sequence_id,
        sequence_id_offset, sequence_id_bytes, late), checked here."""
        scheduler = self.schedulers[model_id]
        if scheduler is None:  # published before we read the table change: read it now
            self.table_changed()
            scheduler = self.schedulers[model_id]
            if scheduler is None:
                self.reject(model_id, Rejection(p, Status.UNAVAILABLE, f"model id {model_id} "
                                                "is not loaded"))
                return
        if extra is not None or scheduler.sequences:
            p = self.check_options(model_id, scheduler, p, extra or NO_OPTIONS)
            if p is None:
                return
        if self.direct[model_id]:  # nothing may overtake a queued request
            self.direct[model_id] = False
            self.core.set_direct(model_id, None)
        refused = scheduler.admit(p)
        if refused is not None:
            self.reject(model_id, refused)

    def check_options(self, model_id: int, scheduler: Scheduler, p: Pending,
                      extra: tuple) -> Pending | None:
        """p with its options checked (a SequencePending for a sequence model), or None
        once refused."""
        params_off, params_bytes, flags, sequence_id, sid_off, sid_bytes, late = extra
        if scheduler.sequences or flags & SEQUENCE_FLAGS or sequence_id or sid_bytes:
            p = self.sequence_request(model_id, p, flags, sequence_id, sid_off, sid_bytes)
            if p is None:
                return None
        if params_bytes:  # hostile bytes: checked here, where an error answers only this request
            try:
                decode_parameters(p.arena.buffer[params_off:params_off + params_bytes])
            except ValueError as e:
                self.reject(model_id, Rejection(p, Status.INVALID_ARG, clip_error(
                    f"model '{scheduler.spec.name}': {e}"), FailureReason.OTHER))
                return None
        if late:
            self.reject(model_id, Rejection(p, Status.UNAVAILABLE, "the server is stopping: it "
                                            "finishes the requests it holds and takes no new one"))
            return None
        return p

    def sequence_request(self, model_id: int, p: Pending, flags: int, sequence_id: int,
                         sid_off: int, sid_bytes: int) -> SequencePending | None:
        """p with its correlation id (a string one copied out of the caller's arena:
        what the scheduler routes by cannot change under it), or None once refused."""
        spec = self.schedulers[model_id].spec
        if not self.schedulers[model_id].sequences:
            self.reject(model_id, Rejection(p, Status.INVALID_ARG, clip_error(
                f"model '{spec.name}' has no sequence_batching: a request to it carries no "
                "sequence id and no sequence START/END flag"), FailureReason.OTHER))
            return None
        corrid = sequence_id
        if sid_bytes:
            try:
                corrid = decode_sequence_id(p.arena.buffer[sid_off:sid_off + sid_bytes])
            except ValueError as e:
                self.reject(model_id, Rejection(p, Status.INVALID_ARG, clip_error(
                    f"model '{spec.name}': {e}"), FailureReason.OTHER))
                return None
        return SequencePending(*(getattr(p, f.name) for f in dataclasses.fields(Pending)),
                               corrid=corrid, flags=flags)

    def reject(self, model_id: int, r: Rejection) -> None:
        """Answers a queued request with an error, unless its lease ended meanwhile
        (its arena is unmapped: nobody is left to answer)."""
        p = r.pending
        if p.arena.ops is None:
            return
        self.maps.record_answers(model_id, [(int(r.status), p.arrived_ns)], int(r.reason))
        p.arena.ops.complete(p.slot_off, p.generation, int(r.status), r.message, [])

    def may_skip_claim(self, client_id: int, ring: RingConsumer) -> bool:
        """The head of a client's ring is claimed and not published. Skip it once it
        has held the head for RING_STALL_NS: then the owner's publish fails and a live
        client pushes again. Only that client's own requests wait meanwhile."""
        # keyed on the position alone: a client rewriting its claim word's owner bits
        # must not keep its stall from maturing
        now, at = now_ns(), ring.pos
        stall = self.stalls.get(client_id)
        if stall is None or stall[0] != at:
            self.stalls[client_id] = (at, now)
            return False
        if now - stall[1] < RING_STALL_NS:
            return False
        del self.stalls[client_id]
        self.ring_damaged(client_id, f"a claim in its ring stayed unpublished for "
                          f"{(now - stall[1]) / 1e6:.0f} ms")
        return True

    def stall_ends(self) -> int | None:
        """When the grace of the earliest stalled claim ends, or a ring left behind by
        the tries bound is due (None: neither): the loop must come back then."""
        due = [since + RING_STALL_NS for _, since in self.stalls.values()]
        if self.revisit_at:
            due.append(self.revisit_at)
        return min(due, default=None)

    def ring_damaged(self, client_id: int, what: str) -> None:
        """A client broke its ring's rules: its entries may have been lost, so sweep
        its slots now and often for a while."""
        now = now_ns()
        if now - self.damage_logged_at >= SWEEP_NS:  # one line a second, not a flood
            log.warning("client %d's submission ring: %s", client_id, what)
            self.damage_logged_at = now
        self.sweep_at = 0
        self.damaged[client_id] = now + SWEEP_NS

    def next_sweep(self) -> int | None:
        """When the loop must come back for a sweep: only while a ring is damaged
        (the regular sweep rides on the idle check)."""
        return self.sweep_at if now_ns() < self.damaged_until else None

    # -- requests the ring does not (or no longer) hold ----------------------------
    def housekeeping(self) -> None:
        """Every SWEEP_NS, or at once after ring damage: takes the requests whose ring
        entries were lost, and unmaps the arenas of ended leases (only between
        batches: none is in hand when the loop calls this)."""
        now = now_ns()
        if now < self.sweep_at:
            return
        self.damaged = {c: until for c, until in self.damaged.items() if until > now}
        full = now >= self.full_sweep_at
        if full:  # every lease's slots; in between, only the damaged rings' clients'
            self.full_sweep_at = now + SWEEP_NS
        taken = self.sweep(min_age_ns=SWEEP_NS // 10) if full else 0
        if self.damaged:
            taken += self.sweep(min_age_ns=DAMAGED_SWEEP_NS, clients=tuple(self.damaged))
        if taken and now - self.lost_logged_at >= SWEEP_NS:  # one line a second at most
            log.warning("took requests whose ring entries were lost")
            self.lost_logged_at = now
        if now - self.leases_dropped_at >= SWEEP_NS:
            self.maps.drop_ended_leases()
            self.leases_dropped_at = now
        self.sweep_at = now_ns() + (DAMAGED_SWEEP_NS if self.damaged else SWEEP_NS)

    def recover(self, draining: dict[int, int] | None = None) -> int:
        """After a restart: takes again every request a previous batcher had claimed
        but not handed to a worker (QUEUED outside any assigned mailbox), and every
        SUBMITTED request whose ring entry it had popped. On a first start there are
        no clients and nothing to do. draining: {model index: its withdrawn handle} of
        the models that unload; the requests the previous batcher had accepted for them
        finish, as they would have (a SUBMITTED one was not accepted yet: refused)."""
        layout, srv = self.maps.layout, self.maps.srv
        assigned = set()
        for w in range(layout.n_workers):
            mb = layout.mailbox(w)
            assigned.update(srv.mailbox_next(mb))  # a next batch waiting (repaired first)
            if srv.load32(mb + L["mailbox.state"]) != MailboxState.IDLE:
                assigned.update(srv.mailbox_batch(mb))
        honoured = None
        if draining:
            handles = array.array("I", [0xFFFFFFFF] * self.n_models)  # no handle is that
            for index, handle in draining.items():
                handles[index] = handle
            honoured = handles.tobytes()
        recovered = self.sweep(requeue_unassigned=assigned, min_age_ns=0, honoured=honoured)
        if recovered:
            log.warning("recovered %d request(s) held by the previous batcher", recovered)
        return recovered

    def sweep(self, requeue_unassigned: set[int] | None = None, min_age_ns: int = SWEEP_NS // 10,
              honoured: bytes | None = None, clients=None) -> int:
        """Takes every SUBMITTED request of a live lease that the ring does not hold:
        its entry was lost (its client overwrote its ring's cells) or popped by a
        batcher that died. Slot states, in each client's own arena, are the truth; the ring only
        says where to look first. A late duplicate entry is ignored by take().
        With requeue_unassigned (after a restart), QUEUED requests whose shadow index
        is not in that set are taken again too. A request younger than min_age_ns (by
        its client's ENQUEUE stamp) is left to its ring entry: its push may be under
        way. clients: only these (None: every lease). Returns how many were taken."""
        layout = self.maps.layout
        now = now_ns()
        taken = 0
        for client_id in range(layout.max_clients) if clients is None else clients:
            state, lease = self.maps.lease_of(client_id)
            mapped = self.maps.arena(client_id, lease) if state == ClientState.ALIVE else None
            if mapped is None:
                continue
            arena, alayout = mapped
            in_ring = set(self.ring_in(client_id, arena, alayout).pending())
            for slot in range(layout.slots_per_client):
                off = alayout.slot(slot)
                # SYNC POINT: the seq_cst load pairs with the client's release store of
                # SUBMITTED (shms_slot_submit); take() re-checks it with its CAS.
                st = arena.ops.load32(off + L["slot.state"])
                accepted = None  # the withdrawn handles honoured for this request
                if st == SlotState.QUEUED and requeue_unassigned is not None \
                        and layout.shadow_index(client_id, slot) not in requeue_unassigned:
                    if not arena.ops.cas32(off + L["slot.state"], SlotState.QUEUED, SlotState.SUBMITTED):
                        continue
                    accepted = honoured  # a predecessor accepted it
                elif st != SlotState.SUBMITTED:
                    continue
                elif now - arena.ops.load64(off + ENQUEUE_STAMP) < min_age_ns:
                    continue
                gen = arena.ops.load32(off + L["slot.generation"])
                # a request taken back from QUEUED is taken here even if a late duplicate
                # entry is in the ring (which take() then ignores): its ring entry would
                # come without the honoured handles
                if accepted is None and (client_id, slot, gen) in in_ring:
                    continue
                self.take(client_id, slot, gen, accepted)
                taken += 1
        return taken
