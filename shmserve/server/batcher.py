"""Batcher process: drains the request ring, validates each request, keeps one
queue per model, forms dynamic batches and hands them to idle instance workers.

    python -m shmserve.server.batcher   (started by the coordinator; boot message on stdin)
"""
from __future__ import annotations

import collections
import dataclasses
import logging

from .._core import now_ns
from ..protocol import (LAYOUT, MAX_BATCH_REQUESTS, POP_CORRUPT, POP_OK, POP_STALLED, ClientState,
                       RingConsumer, SlotState, Status, Timestamp)
from .repository import ModelSpec
from .maps import ServerMaps, child_setup

L = LAYOUT
log = logging.getLogger("shmserve.batcher")
IDLE_CHECK_NS = 100_000_000  # wake at least this often to notice a dead coordinator
RING_STALL_NS = 20_000_000  # a live client's unpublished ring claim is skipped after this
SWEEP_NS = 1_000_000_000  # look for SUBMITTED requests the ring lost this often
SUSPECT_NS = 1_000_000_000  # after a stall, that lease's unpublished head claims are skipped at once


@dataclasses.dataclass
class Pending:
    shadow: int
    rows: int
    key: bytes
    arrived_ns: int
    arena: object
    slot_off: int
    generation: int = 0  # of the slot's request, to answer it


class ModelQueue:
    def __init__(self, model_id: int, spec: ModelSpec, workers: list[int]):
        self.model_id = model_id
        self.spec = spec
        self.workers = workers
        self.queue: collections.deque[Pending] = collections.deque()
        self.max_rows = max(spec.max_batch_size, 1)
        self.delay_ns = spec.max_queue_delay_us * 1000
        self.preferred = spec.preferred_batch_sizes

    def next_batch(self, now_ns: int) -> tuple[list[Pending] | None, int | None]:
        """Triton's dynamic batching rules, on the queue's head.

        Returns (batch, None) when a batch should go now, or (None, deadline_ns)
        when it is worth waiting for more requests until deadline_ns."""
        head = self.queue[0]
        if not self.spec.dynamic_batching:
            return [self.queue.popleft()], None
        picked, rows, preferred_prefix = [], 0, 0
        skipped = more = False
        for p in self.queue:
            if p.key != head.key:  # different shapes never share a batch
                skipped = skipped or bool(picked)
                continue
            if rows + p.rows > self.max_rows or len(picked) == MAX_BATCH_REQUESTS:
                more = True
                break
            picked.append(p)
            rows += p.rows
            if rows in self.preferred:
                preferred_prefix = len(picked)
        full = more or rows >= self.max_rows
        expired = now_ns - head.arrived_ns >= self.delay_ns
        if preferred_prefix and (full or expired or rows >= self.preferred[-1]):
            picked = picked[:preferred_prefix]
        elif not (full or expired):
            return None, head.arrived_ns + self.delay_ns
        if not skipped:  # the batch is the head of the queue: the common case
            for _ in picked:
                self.queue.popleft()
        else:
            taken = {id(p) for p in picked}
            self.queue = collections.deque(p for p in self.queue if id(p) not in taken)
        return picked, None


class Batcher:
    def __init__(self, boot: dict):
        self.maps = ServerMaps(boot)
        self.n_models = boot["n_models"]
        self.models: list[ModelQueue] = []
        for model_id, d in enumerate(boot["models"]):
            workers = [w for w, m in enumerate(boot["worker_models"]) if m == model_id]
            self.models.append(ModelQueue(model_id, ModelSpec.from_dict(d), workers))
        self.ring = RingConsumer(self.maps.ctl, self.maps.srv.load64(L["server.ring_pos"]))
        self.stall = None  # ((ring position, head seq), since ns) of a claimed, unpublished head
        self.suspects: dict[int, tuple[int, int]] = {}  # client id -> (lease, suspect until ns)
        self.sweep_at = now_ns() + SWEEP_NS
        self.damage_logged_at = 0

    # -- 1. take every published request from the ring ------------------------
    def drain_ring(self) -> bool:
        ring = self.ring
        start, took = ring.pos, False
        if ring.repair():
            self.ring_damaged("enqueue_pos was outside the ring; moved back")
        tries = 0
        while True:
            got = ring.pop()
            if got is None:
                self.stall = None
                break
            kind, a, b, c = got
            if kind == POP_OK:
                took = True
                self.take(a, b, c)
                continue
            if kind == POP_STALLED and not self.may_skip_claim(a, b):
                break
            # Bounded (failed skips included), so that a client rewriting cells as fast
            # as we skip them cannot keep the batcher here; the next pass goes on.
            tries += 1
            if tries > ring.capacity:
                break
            if ring.skip(b):
                # A cell left consumed is what a predecessor that died between popping
                # and saving server.ring_pos leaves: not damage.
                if kind == POP_CORRUPT and b != ring.pos - 1 + ring.capacity:
                    self.ring_damaged(f"ring cell at position {ring.pos - 1} held {b:#x}")
        if ring.pos != start:
            self.maps.srv.store64(L["server.ring_pos"], ring.pos)
        return took

    def take(self, client_id: int, slot: int, gen: int) -> None:
        """Claims, copies and validates one request; answers it at once if invalid."""
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
                                   self.n_models, alayout.data_offset)
        except (IndexError, ValueError) as e:  # arena header destroyed by its owner
            log.warning("client %d: unusable request descriptor: %s", client_id, e)
            return
        if taken is None:
            return  # stale or duplicate entry
        if isinstance(taken[1], str):
            status, msg = taken
            model_id = arena.ops.load32(slot_off + L["slot.request"])
            if model_id < self.n_models:
                self.maps.model_add(model_id, "request_failure", 1)
            arena.ops.complete(slot_off, gen, status, msg, [])
            return
        model_id, rows, key = taken
        q = self.models[model_id]
        p = Pending(layout.shadow_index(client_id, slot), rows, key, now_ns(), arena, slot_off, gen)
        if q.spec.max_queue_size and len(q.queue) >= q.spec.max_queue_size:
            self.reject(q, p, Status.BUSY, f"model '{q.spec.name}': queue is full (max_queue_size "
                        f"{q.spec.max_queue_size}); retry later")
            return
        q.queue.append(p)

    def may_skip_claim(self, owner: int, head_seq: int) -> bool:
        """The ring head is claimed by `owner` and not published. Skip it if that
        lease is dead, if the owner is no client at all (a forged claim), or once it
        has held the head for RING_STALL_NS: then the owner's publish fails and a live
        client pushes again. A lease caught stalling is skipped at once for SUSPECT_NS."""
        if owner >= self.maps.layout.max_clients:
            return True
        state, lease = self.maps.lease_of(owner)
        now = now_ns()
        suspect = self.suspects.get(owner)
        if state != ClientState.ALIVE or (suspect and suspect[0] == lease and now < suspect[1]):
            return True
        if self.stall is None or self.stall[0] != (self.ring.pos, head_seq):
            self.stall = ((self.ring.pos, head_seq), now)
            return False
        if now - self.stall[1] < RING_STALL_NS:
            return False
        # The owner in a claim word is not authenticated (a client may forge another's
        # id): the suspicion lapses, and a skipped honest client just pushes again.
        self.suspects[owner] = (lease, now + SUSPECT_NS)
        self.ring_damaged(f"client {owner} held a ring claim unpublished for "
                          f"{(now - self.stall[1]) / 1e6:.0f} ms")
        return True

    def ring_damaged(self, what: str) -> None:
        """A client broke the ring's rules: entries may have been lost, so sweep now."""
        now = now_ns()
        if now - self.damage_logged_at >= SWEEP_NS:  # one line a second, not a flood
            log.warning("request ring: %s", what)
            self.damage_logged_at = now
        self.sweep_at = 0

    # -- 0. requests the ring does not (or no longer) hold ----------------------
    def recover(self) -> int:
        """After a restart: takes again every request a previous batcher had claimed
        but not handed to a worker (QUEUED outside any assigned mailbox), and every
        SUBMITTED request whose ring entry it had popped. On a first start there are
        no clients and nothing to do."""
        layout, srv = self.maps.layout, self.maps.srv
        assigned = set()
        for w in range(layout.n_workers):
            mb = layout.mailbox(w)
            if srv.load32(mb + L["mailbox.state"]) != 0:
                n = min(srv.load32(mb + L["mailbox.n"]), MAX_BATCH_REQUESTS)
                assigned.update(srv.load32(mb + L["mailbox.shadow"] + 4 * i) for i in range(n))
        recovered = self.sweep(requeue_unassigned=assigned, min_age_ns=0)
        if recovered:
            log.warning("recovered %d request(s) held by the previous batcher", recovered)
        return recovered

    def sweep(self, requeue_unassigned: set[int] | None = None, min_age_ns: int = SWEEP_NS // 10) -> int:
        """Takes every SUBMITTED request of a live lease that the ring does not hold:
        its entry was lost (a client overwrote ring cells) or popped by a batcher that
        died. Slot states, in each client's own arena, are the truth; the ring only
        says where to look first. A late duplicate entry is ignored by take().
        With requeue_unassigned (after a restart), QUEUED requests whose shadow index
        is not in that set are taken again too. A request younger than min_age_ns (by
        its client's ENQUEUE stamp) is left to its ring entry: its push may be under
        way. Returns how many were taken."""
        layout = self.maps.layout
        in_ring = set(self.ring.pending())
        now = now_ns()
        stamp = L["slot.t_ns"] + 8 * Timestamp.ENQUEUE
        taken = 0
        for client_id in range(layout.max_clients):
            state, lease = self.maps.lease_of(client_id)
            mapped = self.maps.arena(client_id, lease) if state == ClientState.ALIVE else None
            if mapped is None:
                continue
            arena, alayout = mapped
            for slot in range(layout.slots_per_client):
                off = alayout.slot(slot)
                st = arena.ops.load32(off + L["slot.state"])
                if st == SlotState.QUEUED and requeue_unassigned is not None \
                        and layout.shadow_index(client_id, slot) not in requeue_unassigned:
                    if not arena.ops.cas32(off + L["slot.state"], SlotState.QUEUED, SlotState.SUBMITTED):
                        continue
                elif st != SlotState.SUBMITTED:
                    continue
                elif now - arena.ops.load64(off + stamp) < min_age_ns:
                    continue
                gen = arena.ops.load32(off + L["slot.generation"])
                if (client_id, slot, gen) in in_ring:
                    continue
                self.take(client_id, slot, gen)
                taken += 1
        return taken

    # -- 2. hand batches to idle workers ---------------------------------------
    def dispatch(self) -> int | None:
        """Hands batches to idle workers. Returns the earliest time (ns) at which the
        loop must run again without being rung: a batch's queue delay running out, or
        now when a worker went idle while we looked."""
        srv, layout = self.maps.srv, self.maps.layout
        deadline = None
        now = now_ns()
        for q in self.models:
            if q.queue and not srv.load32(layout.model(q.model_id) + L["model.ready"]):
                self.fail_queue(q)
            if q.queue and q.spec.queue_timeout_us:
                expires = self.expire_queue(q, now)
                if expires is not None:
                    deadline = expires if deadline is None else min(deadline, expires)
            busy, retired = [], 0
            for w in q.workers:
                mb = layout.mailbox(w)
                pid = srv.load32(mb + L["mailbox.pid"])
                if pid == L["MAILBOX_RETIRED"]:  # its last batch has nobody else to answer it
                    self.maps.fail_batch(w, q.model_id, f"model '{q.spec.name}': the instance "
                                         "executing this request crash-looped and was retired")
                    retired += 1
                    continue
                if not q.queue:
                    continue
                if srv.load32(mb + L["mailbox.state"]) != 0 or pid == 0:
                    busy.append(mb)
                    continue
                batch, wait_until = q.next_batch(now)
                if batch is None:
                    deadline = wait_until if deadline is None else min(deadline, wait_until)
                    break
                self.hand_over(q, w, batch, now)
            if q.queue and busy and len(busy) == len(q.workers) - retired:
                # SYNC POINT: pairs with the worker's store of IDLE then load of
                # batcher_waiting: either it rings us, or we see it idle here.
                for mb in busy:
                    srv.store32(mb + L["mailbox.batcher_waiting"], 1)
                if any(srv.load32(mb + L["mailbox.state"]) == 0 for mb in busy):
                    deadline = now
        return deadline

    def expire_queue(self, q: ModelQueue, now: int) -> int | None:
        """default_queue_policy with REJECT: answers the requests that waited longer than
        default_timeout_microseconds (the queue is in arrival order). Returns when the
        next one expires."""
        timeout_ns = q.spec.queue_timeout_us * 1000
        while q.queue and now - q.queue[0].arrived_ns >= timeout_ns:
            self.reject(q, q.queue.popleft(), Status.UNAVAILABLE,
                        f"model '{q.spec.name}': request timed out in the queue after "
                        f"{q.spec.queue_timeout_us} us (default_queue_policy)")
        return q.queue[0].arrived_ns + timeout_ns if q.queue else None

    def fail_queue(self, q: ModelQueue) -> None:
        """The model became UNAVAILABLE (its instances crash-looped): answer its queue."""
        while q.queue:
            self.reject(q, q.queue.popleft(), Status.UNAVAILABLE,
                        f"model '{q.spec.name}' is not available (its workers crash-looped; "
                        "see `shmserve models`)")

    def reject(self, q: ModelQueue, p: Pending, status: Status, message: str) -> None:
        """Answers a request of q with an error, unless its lease ended meanwhile (its
        arena is unmapped: nobody is left to answer)."""
        if p.arena.ops is None:
            return
        p.arena.ops.complete(p.slot_off, p.generation, int(status), message, [])
        self.maps.model_add(q.model_id, "request_failure", 1)

    def hand_over(self, q: ModelQueue, worker: int, batch: list[Pending], now: int) -> None:
        # A request whose lease ended while queued has no arena any more (unmapped).
        batch = [p for p in batch if p.arena.ops is not None]
        if not batch:
            return
        queue_ns = 0
        for p in batch:
            p.arena.ops.stamp(p.slot_off, Timestamp.BATCHED)
            queue_ns += now - p.arrived_ns
        self.maps.model_add(q.model_id, "queue_ns", queue_ns)
        # SYNC POINT (in shms_mailbox_assign): the store of ASSIGNED pairs with the
        # worker's doorbell_wait on its mailbox state.
        self.maps.srv.mailbox_assign(self.maps.layout.mailbox(worker), [p.shadow for p in batch])

    # -- 3. the loop -------------------------------------------------------------
    def serve_forever(self) -> None:
        ctl = self.maps.ctl
        bell, sleeping = L["control.doorbell"], L["control.batcher_sleeping"]
        spin = self.maps.spin
        states = [self.maps.layout.mailbox(w) + L["mailbox.state"]
                  for w in range(self.maps.layout.n_workers)]
        while True:
            seen = ctl.load32(bell)
            self.drain_ring()
            if now_ns() >= self.sweep_at:
                if self.sweep():
                    log.warning("request ring: took requests whose ring entries were lost")
                self.maps.drop_ended_leases()
                self.sweep_at = now_ns() + SWEEP_NS
            deadline = self.dispatch()
            if self.stall is not None:  # come back when the stalled claim's grace ends
                end = self.stall[1] + RING_STALL_NS
                deadline = end if deadline is None else min(deadline, end)
            timeout = IDLE_CHECK_NS if deadline is None else max(0, deadline - now_ns())
            # Spin only while no worker computes: then the next event is a new request
            # we want to catch at once; under load the CPU is better left to the workers.
            busy = any(self.maps.srv.load32(off) for off in states)
            # SYNC POINT: clients (ring_push + doorbell_ring) and workers (idle) ring us.
            started = now_ns()
            if ctl.doorbell_wait(bell, sleeping, seen, 0 if busy else spin.budget_ns(), timeout):
                if not busy:
                    spin.record(now_ns() - started)
            elif deadline is None and not self.maps.parent_alive():
                return


def main() -> None:
    boot = child_setup("batcher")
    logging.basicConfig(level=boot.get("log_level", "INFO"), format="[shmserve batcher] %(message)s")
    batcher = Batcher(boot)
    batcher.recover()
    batcher.serve_forever()


if __name__ == "__main__":
    main()

