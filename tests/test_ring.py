"""A client's submission ring (shms_ring_push / pop / skip / repair) in an arena on an
anonymous shared mapping, and the batcher's doorbell; no server involved."""
from __future__ import annotations

import mmap
import os
import time

import pytest

from shmserve import _core
from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L
from shmserve.protocol import RingResult
from shmserve.server.segments import ArenaLayout, control_size, init_control

pytestmark = pytest.mark.timeout(60)


def claim_word(owner: int, pos: int) -> int:
    """shms_claim_word of shmserve.h."""
    return (1 << 63) | ((owner & 0x7FFFFFFF) << 32) | (pos & 0xFFFFFFFF)


class Ring:
    """A producer view and the consumer's view of one ring, as the client and the
    batcher hold them (protocol.Ring / RingConsumer)."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # an arena of `capacity` slots has a ring that large
        layout = ArenaLayout.for_data(capacity, 0)
        assert layout.ring_capacity == capacity
        self.mm = mmap.mmap(-1, layout.segment_bytes)  # MAP_SHARED: forks see it
        self.ops = _core.Mapping(self.mm)
        self.ops.init_arena(capacity, 0, 1, 1)
        self.producer = P.Ring(self.ops)
        assert (self.producer.offset, self.producer.capacity) == (layout.ring_offset, capacity)
        self.srv = _core.Mapping(bytearray(64))  # where the batcher keeps its position
        self.consumer = P.RingConsumer(self.ops, layout.ring_offset, capacity, self.srv, 0)

    def cell(self, pos: int) -> int:
        return self.producer.offset + (pos % self.capacity) * L["ring_cell.size"]

    def seq(self, pos: int) -> int:
        return self.ops.load64(self.cell(pos))

    @property
    def enqueue_pos(self) -> int:
        return self.ops.load64(L["arena.enqueue_pos"])

    @property
    def dequeue_pos(self) -> int:
        return self.consumer.pos

    def push(self, owner, slot, gen):
        return self.producer.push(owner, slot, gen)

    def pop(self):
        """(client, slot, gen), None when empty, ("stalled", owner) or ("corrupt", seq)."""
        got = self.consumer.pop()
        if got is None:
            return None
        kind, a, b, c = got
        if kind == P.POP_OK:
            return (a, b, c)
        return ("stalled", a) if kind == P.POP_STALLED else ("corrupt", b)

    def skip(self):
        got = self.consumer.pop()
        assert got is not None and got[0] != P.POP_OK, got
        return self.consumer.skip(got[2])


def test_fifo_and_fields():
    r = Ring(8)
    entries = [(1, 2, 3), (0, 0, 0), (2**31 - 1, 2**32 - 1, 2**32 - 1), (5, 31, 77)]
    for e in entries:
        assert r.push(*e) == RingResult.OK
    assert [r.pop() for _ in entries] == entries
    assert r.pop() is None
    assert r.enqueue_pos == r.dequeue_pos == len(entries)


def test_full_ring():
    r = Ring(4)
    for i in range(4):
        assert r.push(1, i, i) == RingResult.OK
    assert r.push(1, 9, 9) == RingResult.FULL
    assert r.push(2, 9, 9) == RingResult.FULL
    assert r.enqueue_pos == 4  # a refused push moves nothing
    assert r.pop() == (1, 0, 0)
    assert r.push(1, 4, 4) == RingResult.OK
    assert r.push(1, 5, 5) == RingResult.FULL
    assert [r.pop() for _ in range(4)] == [(1, i, i) for i in range(1, 5)]
    assert r.pop() is None


def test_wrap_around_many_laps():
    r = Ring(4)
    pushed = popped = 0
    for lap in range(5000):
        k = 1 + lap % 4
        for _ in range(k):
            assert r.push(3, pushed % 32, pushed) == RingResult.OK
            pushed += 1
        for _ in range(k):
            assert r.pop() == (3, popped % 32, popped)
            popped += 1
        assert r.pop() is None
    assert r.enqueue_pos == r.dequeue_pos == pushed > 4 * 5000 // 2


def test_claimed_unpublished_cell_stalls_and_is_skipped():
    r = Ring(4)
    assert r.push(1, 0, 10) == RingResult.OK
    assert r.pop() == (1, 0, 10)
    # Client 7 claimed position 1 and died before publishing (and before moving
    # enqueue_pos): its cell holds CLAIM(7, 1).
    pos = r.enqueue_pos
    r.ops.store64(r.cell(pos), claim_word(7, pos))
    assert r.pop() == ("stalled", 7)  # naming the owner
    # Another producer is not blocked: it helps enqueue_pos past the claim.
    assert r.push(2, 5, 55) == RingResult.OK
    assert r.enqueue_pos == pos + 2
    assert r.pop() == ("stalled", 7)  # strict order: still stalled on the head
    assert r.consumer.skip(claim_word(3, pos)) is False  # not what the cell holds
    assert r.pop() == ("stalled", 7)
    assert r.skip() is True
    assert r.seq(pos) == pos + r.capacity  # the cell is free for the next lap
    assert r.pop() == (2, 5, 55)
    assert r.pop() is None
    # The ring goes on over the skipped cell for many laps.
    for i in range(40):
        assert r.push(4, i, i) == RingResult.OK
        assert r.pop() == (4, i, i)


def test_late_publish_of_a_skipped_claim_is_reclaimed():
    """The owner of a skipped claim learns it at its publishing CAS; pushing again works."""
    r = Ring(4)
    pos = r.enqueue_pos
    r.ops.store64(r.cell(pos), claim_word(3, pos))  # as if client 3 were between its CASes
    r.ops.store64(L["arena.enqueue_pos"], pos + 1)
    assert r.skip() is True
    assert r.push(3, 1, 1) == RingResult.OK  # its next push lands after the skipped cell
    assert r.pop() == (3, 1, 1)


def test_stale_claim_of_an_older_lap_is_corrupt():
    """A claim word whose position bits belong to another lap is no honest state of
    the head: the consumer reports it (and may skip it), it never reads as a stall."""
    r = Ring(4)
    for i in range(6):
        r.push(1, i, i)
        r.pop()
    pos = r.enqueue_pos
    r.ops.store64(r.cell(pos), claim_word(9, pos - 4))
    assert r.pop() == ("corrupt", claim_word(9, pos - 4))
    assert r.push(1, 0, 0) == RingResult.FULL  # producers cannot use that cell
    assert r.skip() is True
    assert r.push(1, 0, 0) == RingResult.OK
    assert r.pop() == (1, 0, 0)


@pytest.mark.parametrize("forged", [10**9, -10**9, 5])
def test_forged_enqueue_pos_is_repaired_by_the_consumer(forged):
    r = Ring(8)
    for i in range(3):
        assert r.push(1, i, i) == RingResult.OK
    assert r.pop() == (1, 0, 0)
    honest = r.enqueue_pos
    r.ops.store64(L["arena.enqueue_pos"], (honest + forged) % 2**64)
    if forged != 5:
        assert r.consumer.repair() is True
        assert r.enqueue_pos == honest
    else:  # forward inside the window: producers skip the hole, the consumer skips it too
        assert r.consumer.repair() is False
    assert r.push(2, 7, 7) == RingResult.OK
    assert r.pop() == (1, 1, 1)
    assert r.pop() == (1, 2, 2)
    got = []
    for _ in range(20):  # free cells of the hole read as corrupt and are skipped
        e = r.pop()
        if e is None:
            break
        if e[0] == "corrupt":
            assert r.consumer.skip(e[1])
            continue
        got.append(e)
    assert got == [(2, 7, 7)]
    for i in range(20):
        assert r.push(3, i, i) == RingResult.OK
        assert r.pop() == (3, i, i)


def test_header_vandalism_does_not_move_attached_views():
    """The ring's capacity and offset in the arena header are read once (attach), and
    the batcher never reads them (its own geometry): rewriting them changes nothing
    for views already made."""
    r = Ring(8)
    assert r.push(1, 1, 1) == RingResult.OK
    r.ops.store32(L["arena.ring_capacity"], 1 << 30)
    r.ops.store64(L["arena.ring_offset"], 8)
    assert r.push(1, 2, 2) == RingResult.OK
    assert r.pop() == (1, 1, 1)
    assert r.pop() == (1, 2, 2)
    with pytest.raises(ValueError, match="sane submission ring"):
        P.Ring(r.ops)  # a new attach checks the header and refuses it


@pytest.mark.parametrize("field,value", [
    ("arena.ring_offset", 2**64 - 64),  # off + cells wraps around to before the mapping
    ("arena.ring_offset", 64),          # over the header
    ("arena.ring_offset", 1216),        # over the slots
    ("arena.ring_capacity", 4),         # fewer cells than slots
    ("arena.ring_capacity", 12),        # no power of two
    ("arena.slots_offset", 2**40),      # slots past the segment
])
def test_attach_refuses_a_ring_out_of_place(field, value):
    """shms_ring_attach checks the arena header's ring geometry once: the ring lies
    between the header and the slots, one cell per slot at least."""
    r = Ring(32)
    (r.ops.store64 if field != "arena.ring_capacity" else r.ops.store32)(L[field], value)
    with pytest.raises(ValueError, match="sane submission ring"):
        P.Ring(r.ops)


def test_producer_processes_race():
    """4 forked producers x 5000 pushes into a 64-cell ring while this process pops:
    every entry is seen exactly once, each producer's in its own order."""
    producers, per_producer = 4, 5000
    r = Ring(64)
    pids = []
    for p in range(producers):
        pid = os.fork()
        if pid == 0:  # producer: only C calls, then _exit
            code = 0
            try:
                for i in range(per_producer):
                    while True:
                        rc = r.push(p, i & 0xFFFF, i)
                        if rc == RingResult.OK:
                            break
                        if rc != RingResult.FULL:
                            code = 3
                            break
                        os.sched_yield()
            except BaseException:
                code = 4
            os._exit(code)
        pids.append(pid)
    seen = [[] for _ in range(producers)]
    total, stalls = 0, 0
    deadline = time.monotonic() + 45
    try:
        while total < producers * per_producer:
            e = r.pop()
            if e is None or isinstance(e[0], str):  # empty, or a producer mid-publish
                assert e is None or e[0] == "stalled", e
                stalls += e is not None
                assert time.monotonic() < deadline, f"only {total} entries after 45 s"
                os.sched_yield()
                continue
            owner, slot, gen = e
            assert slot == gen & 0xFFFF
            seen[owner].append(gen)
            total += 1
    finally:
        codes = [os.waitpid(pid, 0)[1] for pid in pids]
    assert codes == [0] * producers
    for p in range(producers):
        assert seen[p] == list(range(per_producer)), f"producer {p}"
    assert r.pop() is None
    assert r.enqueue_pos == r.dequeue_pos == producers * per_producer


def test_not_an_arena():
    mm = mmap.mmap(-1, control_size())
    ops = _core.Mapping(mm)
    init_control(ops, os.getpid())
    with pytest.raises(ValueError, match="sane submission ring"):
        P.Ring(ops)  # a control block is no arena
    with pytest.raises(ValueError, match="power of two"):
        ops.ring_push(256, 6, 1, 1, 1)  # a capacity that is no power of two
    with pytest.raises(ValueError, match="overlap the arena header"):
        ops.ring_push(64, 8, 1, 1, 1)
    with pytest.raises(IndexError):
        ops.ring_pop(256, 1 << 20, 0)  # cells past the mapping


def test_mapping_bounds_are_checked():
    mm = mmap.mmap(-1, 4096)
    ops = _core.Mapping(mm)
    with pytest.raises(IndexError):
        ops.load32(4096)
    with pytest.raises(IndexError):
        ops.load64(4092)
    with pytest.raises(IndexError):
        ops.store32(2, 1)  # misaligned
    with pytest.raises(IndexError):
        ops.read_result(4096 - 64)  # a slot does not fit
    with pytest.raises(ValueError, match="power of two"):  # 2**59 cells: 32 * cap wraps to 0
        ops.push_request(256, 2 ** 59, ops, ops, 1, 1, 1, lambda: None)
    with pytest.raises(OverflowError):
        ops.init_arena(1, 2 ** 63, 0, 1)
    ops.release()
    with pytest.raises(ValueError, match="released"):
        ops.load32(0)


def test_tensor_refs_carry_memory_kind_and_device():
    """TensorRef's named fields reach the descriptor: unset is 0 (the caller's arena),
    a value past 16 bits is refused rather than cut."""
    slot = bytearray(P.SLOT_BYTES)
    ops = _core.Mapping(slot)
    inputs = [P.TensorRef((0, 11, 4096, 16, (1, 4))),
              P.TensorRef((1, 11, 4160, 16, (1, 4), P.MemoryKind.CUDA_IPC, 3))]
    ops.write_request(0, 1, 0, inputs, [(0, 0, 4224, 64, ())])
    ref = P.LAYOUT["slot.request"] + P.LAYOUT["request.inputs"]
    kinds = [(ops.load32(ref + i * P.LAYOUT["tensor_ref.size"] + P.LAYOUT["tensor_ref.memory_kind"]))
             for i in range(2)]
    assert kinds == [0, P.MemoryKind.CUDA_IPC | (3 << 16)]  # memory_kind u16, device_id u16
    with pytest.raises(OverflowError, match="device_id"):
        ops.write_request(0, 2, 0, [P.TensorRef((0, 11, 4096, 16, (1, 4), 0, 1 << 16))], [])


def test_release_while_another_thread_waits_is_deferred():
    """A thread sleeps in doorbell_wait (the GIL released) while another releases the
    mapping, as Client.close() from another thread does: the memory stays mapped until
    the wait is out, and the mapping is released then."""
    import threading

    mm = mmap.mmap(-1, 4096)
    ops = _core.Mapping(mm)
    started = threading.Event()
    result = []

    def wait():
        started.set()
        result.append(ops.doorbell_wait(0, 4, 0, 0, 300_000_000))  # nobody rings: times out

    t = threading.Thread(target=wait)
    t.start()
    started.wait()
    while not ops.load32(4):  # the waiter announced itself asleep on the futex
        pass
    ops.release()
    with pytest.raises(BufferError):  # the waiter's use keeps the buffer exported
        mm.close()
    t.join(10)
    assert result == [False]
    with pytest.raises(ValueError, match="released"):
        ops.load32(0)
    mm.close()  # now nothing holds it


def _sole_sleeper(bell, control):
    """sleep_once(seen): the batcher's sole wait on bell.doorbell, its token in
    control.batcher_sleeping (30 s at most), on a thread; returns (thread, [how it woke])."""
    import threading

    word, sleeping = L["bell.doorbell"], L["control.batcher_sleeping"]

    def sleep_once(seen):
        woke = []
        t = threading.Thread(target=lambda: woke.append(
            bell.doorbell_wait(word, sleeping, seen, 0, 30_000_000_000, True, control)),
            daemon=True)
        t.start()
        while not control.load32(sleeping):  # asleep, or about to be
            pass
        return t, woke
    return sleep_once


def _control_and_bell():
    control = _core.Mapping(mmap.mmap(-1, control_size()))
    init_control(control, os.getpid())
    return control, _core.Mapping(mmap.mmap(-1, 4096))


def test_ring_batcher_takes_back_only_the_token_of_the_sleep_it_read():
    """A server process ringing the batcher (shms_doorbell_ring_sole, protocol section
    8): each sleep stores a new token in control.batcher_sleeping; the first ring
    takes it back to 0 and wakes the batcher, moving the doorbell a second time (which
    ends that sleep whatever its `seen`); the rings after it find 0 (no system call).
    A ringer that read the token of an earlier sleep and was preempted cannot clear
    the next one's."""
    control, bell = _control_and_bell()
    sleeping, word = L["control.batcher_sleeping"], L["bell.doorbell"]
    sleep_once = _sole_sleeper(bell, control)

    t, woke = sleep_once(0)
    first = control.load32(sleeping)
    control.ring_batcher(bell)
    assert control.load32(sleeping) == 0  # taken back by the ring, before the waiter ran
    control.ring_batcher(bell)  # a second push of the burst: nothing to wake, nothing to clear
    t.join(10)
    assert not t.is_alive() and woke == [P.Wake.SLEEP], "the ring did not wake the batcher"
    assert bell.load32(word) == 3  # the winning ring's two moves, the other's one

    t, woke = sleep_once(3)
    second = control.load32(sleeping)
    assert second not in (0, first)  # a new token for a new sleep
    assert not control.cas32(sleeping, first, 0)  # the stale ringer's clear fails
    assert control.load32(sleeping) == second and t.is_alive()
    control.ring_batcher(bell)  # so the next push still wakes it
    t.join(10)
    assert not t.is_alive() and woke == [P.Wake.SLEEP]
    assert control.load32(sleeping) == 0 and bell.load32(word) == 5


def test_a_client_wakes_each_sleep_once_without_writing_the_token():
    """A client's ring (shms_doorbell_ring_client, protocol section 8): it reads the
    sleep's token from the control block (read-only to it) and records it in its own
    arena (rang_token); its first push after the batcher fell asleep moves the doorbell
    twice and wakes it, the next pushes of its burst find the token theirs and make no
    system call; the next sleep's new token is woken again. The token stays the
    batcher's until its sleep ends."""
    control, bell = _control_and_bell()
    r = Ring(8)
    sleeping, word, rang = L["control.batcher_sleeping"], L["bell.doorbell"], L["arena.rang_token"]
    sleep_once = _sole_sleeper(bell, control)

    def push(i):
        return r.ops.push_request(r.producer.offset, r.capacity, control, bell, 1, i, i,
                                  lambda: None)

    t, woke = sleep_once(0)
    token = control.load32(sleeping)
    assert push(0) == RingResult.OK
    assert r.ops.load32(rang) == token  # recorded in the client's own arena
    assert push(1) == RingResult.OK  # same sleep: no second wake-up, one move only
    t.join(10)
    assert not t.is_alive() and woke == [P.Wake.SLEEP], "the push did not wake the batcher"
    assert bell.load32(word) == 3  # the first push's two moves, the second's one
    assert control.load32(sleeping) == 0  # the batcher cleared its own token on waking

    t, woke = sleep_once(bell.load32(word))
    assert control.load32(sleeping) not in (0, token)
    assert push(2) == RingResult.OK  # a new sleep: woken again
    t.join(10)
    assert not t.is_alive() and woke == [P.Wake.SLEEP]
    assert [r.pop() for _ in range(3)] == [(1, 0, 0), (1, 1, 1), (1, 2, 2)]


def test_a_read_only_mapping_refuses_writes():
    """A client maps the control block read-only: the Mapping's stores raise instead of
    faulting, and a wait cannot use it for its sleeping word."""
    mm = mmap.mmap(-1, 4096)
    fd = os.memfd_create("ro-test")
    try:
        os.ftruncate(fd, 4096)
        view = _core.Mapping(mmap.mmap(fd, 4096, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)
    assert view.readonly and view.load32(0) == 0
    for write in (lambda: view.store32(0, 1), lambda: view.add32(0, 1),
                  lambda: view.cas32(0, 0, 1), lambda: view.store64(0, 1),
                  lambda: view.put(0, b"x"), lambda: view.ring_batcher(view)):
        with pytest.raises(PermissionError, match="read-only"):
            write()
    with pytest.raises(PermissionError, match="read-only"):
        _core.Mapping(mm).doorbell_wait(0, 4, 0, 0, 1000, True, view)
