"""_core.BatcherCore (csrc/batcher.c): the batcher's per-request work in C, driven
in-process over arenas (each with its client's submission ring) and segments built
here (no server): which requests
drain() takes, which go straight to an idle instance and which are queued, where it
stops for Python, and what hand_over() stamps, records and assigns."""
from __future__ import annotations

import mmap
import os
import types

import numpy as np
import pytest

from shmserve import _core
from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L, DataType, Duration, MailboxState, Status, Timestamp
from shmserve.server.intake import STOP_INVALID, STOP_MAP
from shmserve.server.scheduling import Pending
from shmserve.server.segments import ArenaLayout, control_size, init_control

from helpers import server_segment_with_one_model

pytestmark = pytest.mark.timeout(60)

FP32 = int(DataType.FP32)
SLOTS = 4
QUEUE = int(Duration.QUEUE)  # the model statistics' durations row of queue time


class Rig:
    """A control block and a bell, a server segment with one batched model (IN [4] -> OUT [4],
    FP32) and two instances' mailboxes, and an arena per client with a live lease;
    `arenas` is the batcher's {client_id: (lease, Segment, ArenaLayout)}."""

    def __init__(self, n_clients: int = 2):
        self.cmm = mmap.mmap(-1, control_size())
        self.ctl = _core.Mapping(self.cmm)
        init_control(self.ctl, os.getpid())
        self.bell = _core.Mapping(mmap.mmap(-1, 4096))
        self.n_clients = n_clients
        self.slay, self.smm, self.srv = server_segment_with_one_model(n_clients, SLOTS, 2)
        self.alay = ArenaLayout.for_data(SLOTS, 1 << 16)
        self.mms, self.arenas, self.gens, self.rings = [], {}, {}, []
        for c in range(n_clients):
            mm = mmap.mmap(-1, self.alay.segment_bytes)
            ops = _core.Mapping(mm)
            ops.init_arena(SLOTS, 1 << 16, c, 1)
            self.srv.write_client_entry(self.slay.client(c), 1, 1, 0, self.alay.segment_bytes, "x")
            self.mms.append(mm)
            self.rings.append(P.Ring(ops))
            self.arenas[c] = (1, types.SimpleNamespace(ops=ops), self.alay)
        self.mailboxes = [self.slay.mailbox(w) for w in range(2)]
        for mb in self.mailboxes:  # live, idle instances
            self.srv.store32(mb + L["mailbox.pid"], os.getpid())
            self.srv.store32(mb + L["mailbox.state"], MailboxState.IDLE)
        self.core = _core.BatcherCore(self.ctl, self.bell, self.srv, Pending)
        self.rotor = 0

    def pos(self, client: int) -> int:
        """The batcher's position in a client's ring (its client table entry)."""
        return self.srv.load64(self.slay.client(client) + L["client_entry.ring_pos"])

    def ops(self, client: int):
        return self.arenas[client][1].ops

    def submit(self, client: int, slot: int, rows: int = 1, dtype: int = FP32, **options) -> int:
        """Writes a request into a slot and pushes it on its client's ring; returns its
        generation."""
        mm = self.mms[client]
        d = self.alay.data_offset + slot * 4096
        data = np.arange(rows * 4, dtype=np.float32)
        mm[d:d + data.nbytes] = data.tobytes()
        gen = self.gens[client, slot] = self.gens.get((client, slot), 0) + 1
        extra = (options.get("flags", 0), 0, 0, 0, options.get("parameters_bytes", 0))
        self.ops(client).write_request(self.alay.slot(slot), gen, 0,
                                       [(0, dtype, d, data.nbytes, (rows, 4))],
                                       [(0, FP32, d + 2048, data.nbytes, [])], *extra)
        assert self.rings[client].push(client, slot, gen) == P.RingResult.OK
        return gen

    def drain(self, start: int = 0):
        """Every ring from `start` on; the rings visited before a stop are in
        self.visited."""
        self.visited, items, stop, self.consumed = self.core.drain(start, self.n_clients,
                                                                   self.arenas)
        return items, stop

    def state(self, mb: int) -> int:
        return self.srv.load32(mb + L["mailbox.state"])

    def assigned(self, mb: int) -> list[int]:
        n = self.srv.load32(mb + L["mailbox.n"])
        return [self.srv.load32(mb + L["mailbox.shadow"] + 4 * i) for i in range(n)]

    def stamp(self, client: int, slot: int, which: Timestamp) -> int:
        return self.ops(client).load64(self.alay.slot(slot) + L["slot.t_ns"] + 8 * which)

    def queue_waits(self) -> int:
        return self.srv.model_stats(self.slay.model(0))["durations"][QUEUE][0]


@pytest.fixture
def rig():
    return Rig()


def test_a_lone_request_of_a_direct_model_goes_to_the_first_idle_instance(rig):
    rig.srv.store32(rig.mailboxes[0] + L["mailbox.state"], MailboxState.ASSIGNED)  # busy
    rig.core.set_direct(0, rig.mailboxes)
    rig.submit(1, 2)
    items, stop = rig.drain()
    assert (items, stop) == ([], None)
    assert rig.pos(1) == 1
    mb = rig.mailboxes[1]
    assert rig.state(mb) == MailboxState.ASSIGNED
    assert rig.assigned(mb) == [rig.slay.shadow_index(1, 2)]
    assert rig.stamp(1, 2, Timestamp.BATCHED) > 0
    assert rig.queue_waits() == 1
    assert rig.ops(1).load32(rig.alay.slot(2) + L["slot.state"]) == P.SlotState.QUEUED


def test_no_idle_instance_queues_the_request(rig):
    for mb in rig.mailboxes:
        rig.srv.store32(mb + L["mailbox.state"], MailboxState.ASSIGNED)
    rig.core.set_direct(0, rig.mailboxes)
    gen = rig.submit(0, 1, rows=3)
    items, stop = rig.drain()
    assert stop is None and len(items) == 1
    model_id, p, extra = items[0]
    assert (model_id, extra) == (0, None)
    assert (p.shadow, p.rows, p.slot_off, p.generation, p.client) == (
        rig.slay.shadow_index(0, 1), 3, rig.alay.slot(1), gen, 0)
    assert p.arena is rig.arenas[0][1]
    assert p.key == np.array([2, 4], np.int64).tobytes()  # input 0 of rank 2; its non-batch dims
    assert rig.queue_waits() == 0  # recorded when handed over, not before


def test_a_retired_or_unstarted_instance_is_never_assigned(rig):
    rig.srv.store32(rig.mailboxes[0] + L["mailbox.pid"], 0)  # not started
    rig.srv.store32(rig.mailboxes[1] + L["mailbox.pid"], P.MAILBOX_RETIRED)
    rig.core.set_direct(0, rig.mailboxes)
    rig.submit(0, 0)
    items, _ = rig.drain()
    assert len(items) == 1
    assert [rig.state(mb) for mb in rig.mailboxes] == [MailboxState.IDLE] * 2


def test_two_requests_of_one_model_in_a_pass_both_queue_in_ring_order(rig):
    """Lone means alone in the pass: two go to the scheduler, which may batch them, in
    the order drain visits the rings (from its start on), each ring in its own order."""
    rig.core.set_direct(0, rig.mailboxes)
    rig.submit(1, 0)
    rig.submit(0, 3)
    rig.submit(1, 1)
    items, stop = rig.drain(start=1)
    assert stop is None
    assert [(p.client, p.slot_off) for _, p, _ in items] == [
        (1, rig.alay.slot(0)), (1, rig.alay.slot(1)), (0, rig.alay.slot(3))]
    assert [rig.state(mb) for mb in rig.mailboxes] == [MailboxState.IDLE] * 2


def test_not_direct_queues_and_set_direct_none_turns_it_off(rig):
    rig.core.set_direct(0, rig.mailboxes)
    rig.core.set_direct(0, None)
    rig.submit(0, 0)
    items, _ = rig.drain()
    assert len(items) == 1


def test_a_request_with_options_goes_to_python_with_them(rig):
    rig.core.set_direct(0, rig.mailboxes)
    flags = L["REQUEST_SEQUENCE_START"]
    rig.submit(0, 0, flags=flags)
    items, stop = rig.drain()
    assert stop is None and len(items) == 1
    _, _, extra = items[0]
    assert extra is not None and extra[2] == flags and extra[6] is False
    assert [rig.state(mb) for mb in rig.mailboxes] == [MailboxState.IDLE] * 2


def test_a_request_pushed_after_the_drain_began_is_late(rig):
    rig.core.set_direct(0, rig.mailboxes)
    rig.srv.store64(L["server.drain_since_ns"], 1)  # every ENQUEUE stamp is later
    rig.submit(0, 0)
    items, _ = rig.drain()
    assert items[0][2] is not None and items[0][2][6] is True  # late: Python refuses it


def test_an_unmapped_arena_stops_the_pass_for_python(rig):
    rig.submit(0, 0)
    gen = rig.submit(1, 1)
    rig.submit(0, 2)
    del rig.arenas[1]
    items, stop = rig.drain()
    assert [p.client for _, p, _ in items] == [0, 0]  # client 0's ring first
    assert stop == (STOP_MAP, 1) and rig.visited == 1  # Python maps it, and goes on there
    assert rig.pos(1) == 0  # nothing taken from that ring
    rig.arenas[1] = (2, None, None)  # a mapping of an ended lease is not used either
    items, stop = rig.drain(start=1)
    assert items == [] and stop == (STOP_MAP, 1) and rig.visited == 0
    rig.arenas[1] = (1, types.SimpleNamespace(ops=rig.rings[1].ops), rig.alay)
    items, stop = rig.drain(start=1)
    assert [(p.client, p.generation) for _, p, _ in items] == [(1, gen)] and stop is None
    assert rig.pos(1) == 1


def test_an_invalid_request_is_claimed_and_stopped_for_python_to_answer(rig):
    gen = rig.submit(0, 1, dtype=int(DataType.INT32))
    rig.submit(1, 0)
    items, stop = rig.drain()
    assert items == []
    assert stop[:4] == (STOP_INVALID, 0, 1, gen)
    status, message, lease = stop[4:]
    assert status == Status.INVALID_ARG and "IN" in message and lease == 1
    items, stop = rig.drain()  # the rest of the ring next
    assert len(items) == 1 and stop is None


def test_hostile_entries_are_dropped_without_an_answer(rig):
    """A ring is its client's alone: an entry naming another client (submitted there
    or not), no slot, or a stale generation is dropped."""
    gen = rig.submit(1, 3)  # client 1's own request, in its own ring
    rig.submit(0, 0)
    ring = rig.rings[0]
    assert ring.push(7, 0, 1) == P.RingResult.OK  # no such client
    assert ring.push(0, SLOTS + 3, 1) == P.RingResult.OK  # no such slot
    assert ring.push(1, 3, gen) == P.RingResult.OK  # client 1's request, named by client 0
    assert ring.push(0, 1, 1) == P.RingResult.FULL  # a ring holds as many entries as slots
    assert rig.rings[1].push(1, 2, 9) == P.RingResult.OK  # nothing submitted there: stale
    items, stop = rig.drain()
    assert [(p.client, p.slot_off) for _, p, _ in items] == [(0, rig.alay.slot(0)),
                                                             (1, rig.alay.slot(3))]
    assert stop is None and rig.pos(0) == 4 and rig.pos(1) == 2
    assert rig.drain() == ([], None)  # a duplicate of nothing: still nothing


def test_a_dead_lease_is_dropped(rig):
    rig.submit(1, 0)
    rig.srv.store32(rig.slay.client(1) + L["client_entry.state"], P.ClientState.DEAD)
    assert rig.drain() == ([], None)


def test_hand_over_stamps_records_and_assigns_and_leaves_ended_leases_out(rig):
    rig.submit(0, 0)
    rig.submit(1, 1)
    rig.submit(0, 2)
    items, _ = rig.drain()
    batch = [p for _, p, _ in items]  # client 0's ring first, then client 1's
    gone = types.SimpleNamespace(ops=None)  # client 1's lease ended while queued
    batch[2] = Pending(batch[2].shadow, 1, batch[2].key, batch[2].arrived_ns, gone,
                       batch[2].slot_off, batch[2].generation)
    mb = rig.mailboxes[1]
    assert rig.core.hand_over(mb, rig.slay.model(0), batch) == 2
    assert rig.assigned(mb) == [rig.slay.shadow_index(0, 0), rig.slay.shadow_index(0, 2)]
    assert rig.state(mb) == MailboxState.ASSIGNED
    assert rig.stamp(0, 0, Timestamp.BATCHED) and rig.stamp(0, 2, Timestamp.BATCHED)
    assert rig.stamp(1, 1, Timestamp.BATCHED) == 0
    assert rig.queue_waits() == 2


def test_hand_over_of_nothing_left_assigns_nothing(rig):
    rig.submit(1, 1)
    (_, p, _), = rig.drain()[0]
    p.arena = types.SimpleNamespace(ops=None)
    assert rig.core.hand_over(rig.mailboxes[0], rig.slay.model(0), [p]) == 0
    assert rig.state(rig.mailboxes[0]) == MailboxState.IDLE


def test_arguments_out_of_range_are_refused(rig):
    with pytest.raises(IndexError):
        rig.core.set_direct(5, rig.mailboxes)
    with pytest.raises(IndexError):
        rig.core.set_direct(0, [rig.slay.size])  # past the server segment
    with pytest.raises(ValueError):
        rig.core.hand_over(rig.mailboxes[0], rig.slay.model(0), [None] * 1000)


# -- two batches deep: place() and the worker's mailbox_finish() -----------------------


def queued(rig, n: int, client: int = 0) -> list:
    """n requests of one client taken and queued (no direct path)."""
    for slot in range(n):
        rig.submit(client, slot)
    items, stop = rig.drain()
    assert stop is None and len(items) == n
    return [p for _, p, _ in items]


def next_batch(rig, mb: int) -> list[int]:
    n = rig.srv.load32(mb + L["mailbox.next_n"])
    return [rig.srv.load32(mb + L["mailbox.next_shadow"] + 4 * i) for i in range(n)]


def test_place_on_an_idle_instance_assigns_its_batch(rig):
    a, b = queued(rig, 2)
    mb = rig.mailboxes[0]
    assert rig.core.place(mb, rig.slay.model(0), [a, b], False) == (2, 0)
    assert rig.state(mb) == MailboxState.ASSIGNED
    assert rig.assigned(mb) == [a.shadow, b.shadow]
    assert rig.queue_waits() == 2


def test_a_busy_instance_gets_a_next_batch_which_may_grow_until_taken(rig):
    a, b, c = queued(rig, 3)
    mb, model = rig.mailboxes[0], rig.slay.model(0)
    assert rig.core.hand_over(mb, model, [a]) == 1
    assert rig.core.place(mb, model, [b], False) == (1, 1)
    assert rig.state(mb) == MailboxState.ASSIGNED_NEXT
    assert rig.core.place(mb, model, [c], True) == (1, 2)
    assert next_batch(rig, mb) == [b.shadow, c.shadow]
    assert rig.assigned(mb) == [a.shadow]  # the batch running is untouched
    # the worker is done with a: the next batch is its batch now, to run at once
    assert rig.srv.mailbox_finish(mb) is True
    assert rig.state(mb) == MailboxState.ASSIGNED
    assert rig.assigned(mb) == [b.shadow, c.shadow]
    assert rig.srv.mailbox_next(mb) == []
    assert rig.srv.mailbox_finish(mb) is False
    assert rig.state(mb) == MailboxState.IDLE


def test_a_join_that_finds_the_next_batch_taken_becomes_the_next_batch(rig):
    a, b, c = queued(rig, 3)
    mb, model = rig.mailboxes[0], rig.slay.model(0)
    rig.core.hand_over(mb, model, [a])
    rig.core.place(mb, model, [b], False)
    assert rig.srv.mailbox_finish(mb) is True  # the worker took b meanwhile
    assert rig.core.place(mb, model, [c], True) == (1, 1)
    assert next_batch(rig, mb) == [c.shadow] and rig.assigned(mb) == [b.shadow]
    rig.srv.mailbox_finish(mb)
    rig.srv.mailbox_finish(mb)  # and c ran too
    assert rig.core.place(mb, model, [a], True) == (1, 0)  # idle now: its batch


def test_place_refuses_a_next_batch_it_did_not_know_of(rig):
    a, b, c = queued(rig, 3)
    mb, model = rig.mailboxes[0], rig.slay.model(0)
    rig.core.hand_over(mb, model, [a])
    rig.core.place(mb, model, [b], False)
    with pytest.raises(RuntimeError, match="next batch"):
        rig.core.place(mb, model, [c], False)
    assert next_batch(rig, mb) == [b.shadow]


@pytest.mark.parametrize("died", ["worker promoting", "batcher editing"])
def test_a_move_a_dead_process_left_half_done_is_finished_by_its_successor(rig, died):
    a, b = queued(rig, 2)
    mb, model = rig.mailboxes[0], rig.slay.model(0)
    rig.core.hand_over(mb, model, [a])
    rig.core.place(mb, model, [b], False)
    state = MailboxState.PROMOTING if died == "worker promoting" else MailboxState.EDITING
    rig.srv.store32(mb + L["mailbox.state"], state)
    # a restarted batcher counts the next batch as assigned (and repairs an append)
    assert rig.srv.mailbox_next(mb) == [b.shadow]
    if died == "batcher editing":
        assert rig.state(mb) == MailboxState.ASSIGNED_NEXT
    assert rig.srv.mailbox_finish(mb) is True  # a restarted worker moves it in place
    assert rig.assigned(mb) == [b.shadow] and rig.state(mb) == MailboxState.ASSIGNED


# -- a model whose queue is C's (set_queue, dispatch, serve) ----------------------


def c_queue(rig, delay_us: int = 0, overlap: bool = False) -> _core.BatchQueue:
    """Model 0's queue in C: drain() fills it, dispatch() and serve() empty it."""
    q = _core.BatchQueue(Pending, 8, delay_us, (), 0)
    rig.core.set_queue(0, q, rig.mailboxes, rig.slay.model(0), overlap)
    return q


def test_a_c_queued_model_s_requests_never_become_python_objects(rig):
    q = c_queue(rig)
    shadows = [rig.slay.shadow_index(0, s) for s in range(3)]
    for slot in range(3):
        rig.submit(0, slot)
    assert rig.drain() == ([], None) and len(q) == 3
    # greedy: the first idle instance gets all three in one batch (8 rows at most)
    assert rig.core.dispatch(0, _core.now_ns()) == (None, 1)
    assert rig.assigned(rig.mailboxes[0]) == shadows
    assert rig.state(rig.mailboxes[1]) == MailboxState.IDLE
    assert rig.queue_waits() == 3 and rig.stamp(0, 2, Timestamp.BATCHED) > 0
    assert len(q) == 0 and rig.core.dispatch(0, _core.now_ns()) == (None, 0)


def test_a_c_queued_model_waits_for_its_queue_delay(rig):
    q = c_queue(rig, delay_us=1000)
    rig.submit(0, 0)
    rig.drain()
    (p,) = q.ordered()
    assert rig.core.dispatch(0, p.arrived_ns + 10) == (p.arrived_ns + 1_000_000, 0)
    assert [rig.state(mb) for mb in rig.mailboxes] == [MailboxState.IDLE] * 2
    assert rig.core.dispatch(0, p.arrived_ns + 1_000_000) == (None, 1)
    assert rig.assigned(rig.mailboxes[0]) == [p.shadow]


def test_a_c_queued_model_two_deep_fills_and_grows_the_next_batch(rig):
    c_queue(rig, overlap=True)
    mb, other = rig.mailboxes
    rig.srv.store32(other + L["mailbox.pid"], P.MAILBOX_RETIRED)  # one live instance
    rig.srv.store32(mb + L["mailbox.state"], MailboxState.ASSIGNED)  # computing
    rig.submit(0, 0)
    rig.drain()
    assert rig.core.dispatch(0, _core.now_ns()) == (None, 1)
    assert rig.state(mb) == MailboxState.ASSIGNED_NEXT
    assert next_batch(rig, mb) == [rig.slay.shadow_index(0, 0)]
    rig.submit(1, 0)
    rig.drain()
    rig.core.dispatch(0, _core.now_ns())
    assert next_batch(rig, mb) == [rig.slay.shadow_index(0, 0), rig.slay.shadow_index(1, 0)]


def test_a_c_queued_model_with_requests_left_asks_its_busy_instances_to_ring(rig):
    q = _core.BatchQueue(Pending, 1, 0, (), 0)  # one row a batch: the second waits
    rig.core.set_queue(0, q, rig.mailboxes[:1], rig.slay.model(0), False)
    rig.submit(0, 0)
    rig.submit(0, 1)
    rig.drain()
    assert rig.core.dispatch(0, _core.now_ns()) == (None, 1) and len(q) == 1
    assert rig.srv.load32(rig.mailboxes[0] + L["mailbox.batcher_waiting"]) == 1


def serve(rig, until_ns: int | None = None, epoch: int | None = None):
    """BatcherCore.serve from a doorbell value already gone by (so it passes at once),
    until it gives the loop back; a 1 ms idle check."""
    bell = rig.bell.load32(L["bell.doorbell"])
    now = _core.now_ns()
    states = tuple(mb + L["mailbox.state"] for mb in rig.mailboxes)
    epoch = rig.srv.load32(L["server.table_epoch"]) if epoch is None else epoch
    rig.rotor, why, items, stop, handed, consumed, _, _ = rig.core.serve(
        rig.rotor, rig.arenas, bell - 1, None, until_ns or now + 10**9, now + 10**9, epoch, 0,
        1_000_000, states)
    return why, items, stop, handed, consumed


def test_serve_runs_the_loop_in_c_until_the_idle_check(rig):
    c_queue(rig)
    for slot in range(2):
        rig.submit(0, slot)
    why, items, stop, handed, consumed = serve(rig)
    assert (why, items, stop, handed, consumed) == (3, [], None, 1, 2)  # SERVE_IDLE
    assert rig.assigned(rig.mailboxes[0]) == [rig.slay.shadow_index(0, s) for s in range(2)]
    assert rig.pos(0) == 2  # for a successor
    assert rig.srv.model_stats(rig.slay.model(0))["pending"] == 0


def test_serve_gives_back_what_is_python_s(rig):
    c_queue(rig)
    rig.submit(0, 0, flags=L["REQUEST_SEQUENCE_START"])  # options: Python checks them
    why, items, stop, _, consumed = serve(rig)
    assert why == 1 and stop is None and consumed == 1  # SERVE_DRAINED
    assert len(items) == 1 and items[0][2] is not None
    assert serve(rig, epoch=12345)[0] == 5  # SERVE_TABLE: the model table changed
    assert serve(rig, until_ns=1)[0] == 2  # SERVE_TIME: Python's timer is due


def test_a_c_queued_model_s_requests_after_one_for_python_follow_it_there(rig):
    """Each client's requests keep their order: once one of a model's requests in a
    drain goes to Python (options to check), its later ones go too, not into C's queue
    ahead of it."""
    q = c_queue(rig)
    rig.submit(0, 0, flags=L["REQUEST_SEQUENCE_START"])
    rig.submit(0, 1)
    items, stop = rig.drain()
    assert stop is None and len(q) == 0
    assert [p.slot_off for _, p, _ in items] == [rig.alay.slot(0), rig.alay.slot(1)]
    assert items[1][2] is None  # plain: Python queues it into the same C queue, after
    rig.submit(0, 2)
    assert rig.drain() == ([], None) and len(q) == 1  # a new drain: C's again


def test_a_batch_queue_is_used_only_as_built():
    with pytest.raises(RuntimeError, match="__init__"):
        _core.BatchQueue.__new__(_core.BatchQueue).push(Pending(0, 1, b"a", 0, None, 0))
    q = _core.BatchQueue(Pending, 8, 0, (), 0)
    with pytest.raises(RuntimeError, match="initialized once"):
        q.__init__(Pending, 8, 0, (), 0)
    with pytest.raises(ValueError, match="preferred batch sizes"):
        _core.BatchQueue(Pending, 1024, 0, tuple(range(1, 300)), 0)


def test_serve_gives_python_every_ring_from_its_stop_round_again(rig):
    """A drain serve() stops mid-round (here: client 1's arena not mapped) hands Python
    the rest of the round from the stop *and* the rings drained before it: those were
    drained before Python's pass loads the doorbell, and a push to one meanwhile did
    not ring (the batcher was awake)."""
    rig.submit(1, 0)
    del rig.arenas[1]
    rig.rotor = 0
    now = _core.now_ns()
    states = tuple(mb + L["mailbox.state"] for mb in rig.mailboxes)
    bell = rig.bell.load32(L["bell.doorbell"])
    _, why, items, stop, _, _, start, left = rig.core.serve(
        0, rig.arenas, bell - 1, None, now + 10**9, now + 10**9,
        rig.srv.load32(L["server.table_epoch"]), 0, 1_000_000, states)
    assert why == 1 and stop == (STOP_MAP, 1) and items == []  # SERVE_DRAINED
    assert (start, left) == (1, rig.n_clients)  # from ring 1 round to ring 0 again


def test_waiting_means_a_published_entry_at_the_batcher_s_position(rig):
    """BatcherCore.waiting, the lost-ring evidence after a whole sleep: a claim still
    being written (or stalled) moved enqueue_pos but rang nobody yet, so it is not."""
    ops, ring = rig.ops(0), rig.rings[0]
    assert not rig.core.waiting(rig.arenas)
    ops.store64(ring.offset, (1 << 63) | (0 << 32) | 0)  # claimed, as a client between CASes
    ops.store64(L["arena.enqueue_pos"], 1)
    assert not rig.core.waiting(rig.arenas)
    ops.store64(ring.offset, 1)  # published
    assert rig.core.waiting(rig.arenas)


def test_a_lease_whose_arena_cannot_be_mapped_is_passed_over(rig):
    """ServerMaps marks a live lease whose arena's header is not its own (its client
    wrote over it) (lease, None, None): drain and waiting pass it over instead of
    stopping every pass for Python to try mapping it again."""
    rig.submit(1, 0)
    rig.submit(0, 1)
    rig.arenas[1] = (1, None, None)
    items, stop = rig.drain()
    assert stop is None and [p.client for _, p, _ in items] == [0]
    assert rig.pos(1) == 0 and not rig.core.waiting(rig.arenas)
