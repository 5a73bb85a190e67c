"""_core.Batch (csrc/batch.c): a worker's per-batch work in C, driven in-process over
segments built here (no server): which requests it takes, what the model sees, what
each caller gets back, and the statistics it records."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from shmserve import _core
from shmserve.protocol import LAYOUT as L, DataType, MailboxState, Status, Timestamp
from shmserve.server.segments import ArenaLayout

from helpers import server_segment_with_one_model

pytestmark = pytest.mark.timeout(60)

FP32 = int(DataType.FP32)
SLOTS = 2


class Rig:
    """A server segment with one batched model (IN [4] -> OUT [4], FP32) and a
    mailbox, and an arena per client, each with a live lease."""

    def __init__(self, n_clients: int = 2, max_batch: int = 8):
        self.slay, self.smm, self.srv = server_segment_with_one_model(n_clients, SLOTS, 1,
                                                                      max_batch)
        self.alay = ArenaLayout.for_data(SLOTS, 1 << 16)
        self.arenas, self.mapped, self.gens = [], {}, [0] * (SLOTS * n_clients)
        for c in range(n_clients):
            mm = mmap.mmap(-1, self.alay.segment_bytes)
            ops = _core.Mapping(mm)
            ops.init_arena(SLOTS, 1 << 16, c, 1)
            self.srv.write_client_entry(self.slay.client(c), 1, 1, 0, self.alay.segment_bytes, "x")
            self.arenas.append((mm, ops))
        self.mailbox = self.slay.mailbox(0)
        self.batch = _core.Batch(self.srv, self.slay.model(0), self.mailbox)

    def map_all(self) -> None:
        self.mapped.update({c: (1, ops) for c, (_, ops) in enumerate(self.arenas)})

    def submit(self, client: int, slot: int, rows: np.ndarray, capacity: int | None = None) -> int:
        """Writes, takes (as the batcher) and returns the shadow index of a request."""
        mm, ops = self.arenas[client]
        d = self.alay.data_offset + slot * 4096
        mm[d:d + rows.nbytes] = rows.tobytes()
        out = d + 2048
        cap = rows.nbytes if capacity is None else capacity
        gen = self.gens[client * SLOTS + slot] = self.gens[client * SLOTS + slot] + 1
        ops.write_request(self.alay.slot(slot), gen, 0, [(0, FP32, d, rows.nbytes, rows.shape)],
                          [(0, FP32, out, cap, [])])
        shadow = self.slay.shadow_index(client, slot)
        got = ops.take(self.alay.slot(slot), slot, gen, client, 1, self.srv,
                       self.slay.shadow_at(shadow), self.slay.models_offset, 1,
                       self.alay.data_offset)
        assert got[:2] == (0, rows.shape[0]), got
        return shadow

    def answer(self, client: int, slot: int):
        return self.arenas[client][1].read_result(self.alay.slot(slot))

    def out(self, client: int, slot: int, n: int) -> np.ndarray:
        d = self.alay.data_offset + slot * 4096 + 2048
        return np.frombuffer(self.arenas[client][0], np.float32, n * 4, d).reshape(n, 4).copy()


def test_a_batch_of_two_callers_in_one_gather_and_one_scatter():
    rig = Rig()
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.arange(100, 112, dtype=np.float32).reshape(3, 4)
    rig.srv.mailbox_assign(rig.mailbox, [rig.submit(0, 0, a), rig.submit(1, 1, b)])
    # Neither arena is mapped yet: begin names both and touches no slot.
    assert sorted(rig.batch.begin(rig.mapped)) == [(0, 1), (1, 1)]
    assert len(rig.batch) == 0
    rig.map_all()
    assert rig.batch.begin(rig.mapped) == ()
    assert (len(rig.batch), rig.batch.rows) == (2, 5)
    buf, _, shape = rig.batch.input(0)
    assert buf is None and shape == (5, 4)  # two requests: gather
    x = np.empty(shape, np.float32)
    rig.batch.gather(0, x)
    np.testing.assert_array_equal(x, np.concatenate([a, b]))
    rig.batch.scatter(0, x * 2)
    assert rig.batch.finish(int(Status.OK), "", 10, 20, 35) == 2
    assert len(rig.batch) == 0
    for client, slot, rows in ((0, 0, a), (1, 1, b)):
        status, message, results, stamps = rig.answer(client, slot)
        assert (status, message) == (Status.OK, "")
        (ref,) = results
        assert (ref.index, ref.dtype, tuple(ref.shape), ref.nbytes) == (0, FP32, rows.shape, rows.nbytes)
        np.testing.assert_array_equal(rig.out(client, slot, rows.shape[0]), rows * 2)
        assert stamps[Timestamp.COMPUTE_END] == 35
        assert stamps[Timestamp.COMPUTE_START] and stamps[Timestamp.COMPLETE]
    stats = rig.srv.model_stats(rig.slay.model(0))
    assert (stats["execution_count"], stats["inference_count"]) == (1, 5)
    assert stats["batch_requests"] == {2: 1}
    assert stats["durations"][0][0] == 2  # two successes
    assert rig.srv.load64(rig.mailbox + L["mailbox.executions"]) == 1


def test_one_request_is_a_view_of_its_callers_arena():
    rig = Rig()
    rig.map_all()
    a = np.full((1, 4), 7, np.float32)
    rig.srv.mailbox_assign(rig.mailbox, [rig.submit(1, 0, a)])
    assert rig.batch.begin(rig.mapped) == ()
    buf, offset, shape = rig.batch.input(0)
    view = np.frombuffer(buf, np.float32, 4, offset).reshape(shape)
    np.testing.assert_array_equal(view, a)
    assert np.shares_memory(view, np.frombuffer(rig.arenas[1][0], np.uint8))
    assert rig.batch.input(1) is None  # no such input in the request
    del view
    rig.batch.scatter(0, a + 1)
    rig.batch.finish(int(Status.OK), "", 1, 2, 3)
    assert rig.answer(1, 0)[0] == Status.OK


def test_too_small_output_and_failed_batch_are_answered_per_request():
    rig = Rig()
    rig.map_all()
    a = np.ones((2, 4), np.float32)
    small = rig.submit(0, 0, a, capacity=16)  # room for one row of two
    fine = rig.submit(1, 0, a)
    rig.srv.mailbox_assign(rig.mailbox, [small, fine])
    rig.batch.begin(rig.mapped)
    rig.batch.scatter(0, np.zeros((4, 4), np.float32))
    rig.batch.finish(int(Status.OK), "", 1, 2, 3)
    status, message, results, _ = rig.answer(0, 0)
    assert status == Status.OUTPUT_TOO_SMALL and message == "model 'm': output buffer too small for OUT"
    assert results[0].nbytes == 32  # what it needs
    assert rig.answer(1, 0)[0] == Status.OK
    # a failed batch: every request gets the status and message, no results
    rig.srv.mailbox_assign(rig.mailbox, [rig.submit(0, 1, a), rig.submit(1, 1, a)])
    rig.batch.begin(rig.mapped)
    rig.batch.finish(int(Status.INTERNAL), "model 'm' raised", 1, 2, 3)
    for c in (0, 1):
        assert rig.answer(c, 1)[:3] == (Status.INTERNAL, "model 'm' raised", [])
    stats = rig.srv.model_stats(rig.slay.model(0))
    assert stats["durations"][0][0] == 1 and stats["durations"][1][0] == 3  # success, fail


def test_requests_of_ended_leases_and_stale_slots_are_skipped():
    rig = Rig()
    rig.map_all()
    a = np.ones((1, 4), np.float32)
    gone, stale, live = rig.submit(0, 0, a), rig.submit(0, 1, a), rig.submit(1, 0, a)
    rig.srv.store32(rig.slay.client(0) + L["client_entry.generation"], 2)  # a newer lease
    rig.srv.mailbox_assign(rig.mailbox, [gone, stale, live])
    assert rig.batch.begin(rig.mapped) == ()
    assert (len(rig.batch), rig.batch.rows) == (1, 1)
    rig.batch.finish(int(Status.INTERNAL), "x", 1, 2, 3)
    # the same request twice (again=False): the second sees it RUNNING, not QUEUED
    again = rig.submit(1, 1, a)
    rig.srv.mailbox_assign(rig.mailbox, [again, again])
    rig.batch.begin(rig.mapped)
    assert len(rig.batch) == 1
    rig.batch.finish(int(Status.INTERNAL), "x", 1, 2, 3)


def test_misuse_raises_naming_the_problem():
    rig = Rig()
    rig.map_all()
    with pytest.raises(ValueError, match="no request in hand"):
        rig.batch.input(0)
    a = np.ones((2, 4), np.float32)
    rig.srv.mailbox_assign(rig.mailbox, [rig.submit(0, 0, a), rig.submit(1, 0, a)])
    rig.batch.begin(rig.mapped)
    with pytest.raises(ValueError, match="input 0 is 64 bytes, out holds 16"):
        rig.batch.gather(0, np.empty((1, 4), np.float32))
    with pytest.raises(ValueError, match="batch's 4 rows first"):
        rig.batch.scatter(0, np.zeros((3, 4), np.float32))
    with pytest.raises(IndexError, match="output 1 of 1"):
        rig.batch.scatter(1, np.zeros((4, 4), np.float32))
    with pytest.raises(TypeError, match="lease, Mapping"):
        rig.batch.begin({0: "not a pair"})
    assert rig.srv.load32(rig.mailbox + L["mailbox.state"]) == MailboxState.ASSIGNED
