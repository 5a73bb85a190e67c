"""A client lease driven by hand, as a buggy or hostile caller would drive one: the
tests' hostile cases and bench/isolation.py's attackers."""
from __future__ import annotations

import os
import struct
import socket
import time
from pathlib import Path

from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L
from shmserve.segments import Segment


class RawLease:
    """A client lease driven by hand, as a buggy or hostile caller would: the control
    socket for the lease, then direct writes into its own arena (slots, submission ring)
    and the bell. Protocol version 5: the hello sends [arena, control (O_RDONLY), bell];
    the control block is mapped read-only (`ctl.readonly`: a write raises
    PermissionError), the bell and the arena read-write."""

    def __init__(self, socket_path: Path, arena_bytes: int = 1 << 20):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(socket_path))
        self.sock.sendall(P.pack_frame({"op": P.OP_HELLO, "version": P.PROTOCOL_VERSION,
                                        "pid": os.getpid(), "arena_bytes": arena_bytes}))
        hello, fds = P.recv_frame_fds(self.sock, 3)
        assert hello["ok"], hello
        assert len(fds) == 3, fds
        self.hello = hello
        self.client_id = hello["client_id"]
        # kept open: a hostile caller may ftruncate its arena, or try to reopen the
        # control descriptor read-write through /proc/self/fd
        self.arena_fd, self.control_fd, self.bell_fd = fds
        self.control = Segment.from_fd(self.control_fd, hello["control_bytes"], "raw control",
                                       readonly=True)
        self.bell = Segment.from_fd(self.bell_fd, hello["bell_bytes"], "raw bell")
        self.arena = Segment.from_fd(self.arena_fd, hello["arena_bytes"], "raw arena")
        self.ctl, self.bell_ops = self.control.ops, self.bell.ops
        self.ops, self.buf = self.arena.ops, self.arena.buffer
        self.ring = P.Ring(self.ops)  # this lease's submission ring, in its arena
        self.arena_bytes = hello["arena_bytes"]
        self.data_offset = hello["data_offset"]
        self.n_slots = hello["n_slots"]
        self.model_ids = {m["name"]: m["id"] for m in hello["models"]}
        self.generations = [0] * self.n_slots

    def cell(self, pos: int) -> int:
        """Arena offset of the ring cell of position pos."""
        return self.ring.offset + (pos % self.ring.capacity) * L["ring_cell.size"]

    @property
    def enqueue_pos(self) -> int:
        return self.ops.load64(L["arena.enqueue_pos"])

    def slot_offset(self, slot: int) -> int:
        return self.hello["slots_offset"] + slot * P.SLOT_BYTES

    def write_raw_request(self, slot: int, model_id: int, n_inputs: int, n_outputs: int,
                          inputs=(), outputs=()) -> int:
        """Writes a shms_request field by field at the header's offsets (no client-side
        checks at all). Each tensor is (index, dtype, ndim, offset, nbytes, shape[<=8])
        and optionally memory_kind, device_id. Returns the generation to push."""
        off = self.slot_offset(slot)
        req = off + L["slot.request"]
        self.buf[req:req + L["request.size"]] = bytes(L["request.size"])
        for field, value in (("model_id", model_id), ("n_inputs", n_inputs),
                             ("n_outputs", n_outputs)):
            self._put(req, "request", field, value)
        ref = L["tensor_ref.size"]
        for base, tensors in ((req + L["request.inputs"], inputs),
                              (req + L["request.outputs"], outputs)):
            for i, tensor in enumerate(tensors):
                at = base + i * ref
                names = ("index", "dtype", "ndim", "offset", "nbytes", "shape", "memory_kind",
                         "device_id")
                for field, value in zip(names, tensor):
                    if field == "shape":
                        for d, dim in enumerate(value):
                            self._put(at + 8 * d, "tensor_ref", field, dim, width=8)
                    else:
                        self._put(at, "tensor_ref", field, value)
        gen = self.generations[slot] = (self.generations[slot] + 1) & 0xFFFFFFFF
        self._put(off, "slot", "generation", gen)
        self.ops.store32(off + L["slot.state"], P.SlotState.SUBMITTED)
        return gen

    def _put(self, base: int, struct_name: str, field: str, value: int, width: int = 0) -> None:
        """Any integer into a field, cut to the field's width as a hostile client would."""
        width = width or L[f"{struct_name}.{field}.bytes"]
        at = base + L[f"{struct_name}.{field}"]
        self.buf[at:at + width] = (value & (2 ** (8 * width) - 1)).to_bytes(width, "little")

    def push(self, slot: int, gen: int, client_id: int | None = None) -> int:
        """One push attempt on this lease's own ring (an entry naming client_id, by
        default its own), then the bell rung as a client rings it; returns the
        shms_ring_result (OK, FULL, RECLAIMED)."""
        cid = self.client_id if client_id is None else client_id
        rc = self.ring.push(cid, slot, gen)
        self.ring_bell()
        return rc

    def push_request(self, slot: int, gen: int) -> int:
        """An honest client's push (shms_push_request: the protocol's retries, then the
        bell), through the C core."""
        return self.ops.push_request(self.ring.offset, self.ring.capacity, self.ctl,
                                     self.bell_ops, self.client_id, slot, gen, lambda: None)

    def ring_bell(self) -> None:
        """shms_doorbell_ring_client, step by step: move bell.doorbell; if the batcher
        sleeps (its token in the read-only control block) and this lease has not woken
        that sleep yet (arena.rang_token), move it again and wake it."""
        bell, rang = L["bell.doorbell"], L["arena.rang_token"]
        self.bell_ops.add32(bell, 1)
        token = self.ctl.load32(L["control.batcher_sleeping"])
        if token:
            mine = self.ops.load32(rang)
            if mine != token and self.ops.cas32(rang, mine, token):
                self.bell_ops.add32(bell, 1)
                self.bell_ops.wake(bell, 1)

    def state(self, slot: int) -> int:
        return self.ops.load32(self.slot_offset(slot) + L["slot.state"])

    def wait_answer(self, slot: int, timeout: float = 10.0):
        """(status, error, results) once the server answered the slot (read_result
        frees it again); None on timeout."""
        off = self.slot_offset(slot)
        deadline = time.monotonic() + timeout
        while self.ops.load32(off + L["slot.state"]) != P.SlotState.DONE:
            if time.monotonic() > deadline:
                return None
            seen = self.ops.load32(L["arena.completions"])
            if self.ops.load32(off + L["slot.state"]) == P.SlotState.DONE:
                break
            self.ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen, 0, 20_000_000)
        status, error, results, _ = self.ops.read_result(off)
        return status, error, results

    def free(self, slot: int) -> None:
        self.ops.store32(self.slot_offset(slot) + L["slot.state"], P.SlotState.FREE)

    def wait_done(self, slot: int, timeout: float = 10.0):
        """(status, error) once the server answered the slot, which is freed; None on
        timeout."""
        answer = self.wait_answer(slot, timeout)
        if answer is None:
            return None
        self.free(slot)
        return answer[:2]

    def close(self) -> None:
        self.sock.close()
        for seg in (self.control, self.bell, self.arena):
            seg.close()
        for fd in (self.arena_fd, self.control_fd, self.bell_fd):
            os.close(fd)


# ---------------------------------------------------------------- attacks (protocol v5)
# What a hostile caller can still write under protocol version 5: its own arena (its
# slots and its own submission ring) and the bell page. Each attack is one round,
# attack(raw, victim_id, rng), run in a loop with its pause by attacker(); the tests
# (tests/test_hostile.py) and bench/isolation.py run the same rounds.

def claim_head(raw: RawLease, owner: int) -> None:
    """Claims the head cell of the caller's own ring in owner's name (any client id:
    the owner in a claim word is whatever its writer puts there) and never publishes;
    moves enqueue_pos past it as a producer would."""
    pos = raw.enqueue_pos
    raw.ops.store64(raw.cell(pos), (1 << 63) | ((owner & 0x7FFFFFFF) << 32) | (pos & 0xFFFFFFFF))
    raw.ops.store64(L["arena.enqueue_pos"], pos + 1)


def _own_claim(raw, victim_id, rng):
    claim_head(raw, raw.client_id)


def _forged_claim(raw, victim_id, rng):
    claim_head(raw, victim_id)


def _enqueue_jump(raw, victim_id, rng):
    raw.ops.store64(L["arena.enqueue_pos"], raw.enqueue_pos + 10**9)


def _ring_header(raw, victim_id, rng):
    """The arena header's ring geometry rewritten: the batcher uses its own."""
    raw.ops.store64(L["arena.ring_offset"], 8)
    raw.ops.store32(L["arena.ring_capacity"], 1 << 30)


def _garbage_cells(raw, victim_id, rng):
    """Random words in every cell of the caller's ring (seq, client, slot, generation)."""
    words = rng.integers(0, 2**63, raw.ring.capacity * L["ring_cell.size"] // 8)
    at = raw.ring.offset
    raw.buf[at:at + 8 * len(words)] = words.astype("<u8").tobytes()


def _foreign_entries(raw, victim_id, rng):
    """Published entries naming the victim and each of its slots (with plausible
    generations), pushed on the caller's own ring: the batcher drops them (a ring's
    entries are its client's alone)."""
    for slot in range(raw.n_slots):
        raw.ring.push(victim_id, slot, int(rng.integers(1, 64)))
    raw.ring_bell()


def _bell_moved_back(raw, victim_id, rng):
    """bell.doorbell stored back to the value it had when the attack began, in a tight
    loop: a push's move of it is undone before the batcher sees it."""
    raw.bell_ops.store32(L["bell.doorbell"], raw.pinned_bell)


def _doorbell_loop(raw, victim_id, rng):
    """The batcher's doorbell rung for nothing: moved and FUTEX_WAKEd, in a loop (a
    wake needs no token: any process that maps the bell can issue one)."""
    raw.bell_ops.add32(L["bell.doorbell"], 1)
    raw.bell_ops.wake(L["bell.doorbell"], 1)


def _steal_wake_ups(raw, victim_id, rng):
    """Threads of the caller sleep on bell.doorbell themselves (FUTEX_WAIT needs no
    write access): a push's FUTEX_WAKE of one waiter wakes the oldest, one of them,
    not the batcher. Started once; stopped by stop_stealing()."""
    if getattr(raw, "stealers", None):
        return
    import threading

    raw.stop_stealers = threading.Event()
    # the attacker's own count of sleepers, in its own arena (doorbell_wait writes one)
    sleepers = raw.arena_bytes - 64

    def steal():
        while not raw.stop_stealers.is_set():
            seen = raw.bell_ops.load32(L["bell.doorbell"])
            raw.bell_ops.doorbell_wait(L["bell.doorbell"], sleepers, seen, 0, 50_000_000,
                                       False, raw.ops)

    raw.stealers = [threading.Thread(target=steal, daemon=True) for _ in range(4)]
    for t in raw.stealers:
        t.start()


def stop_stealing(raw) -> None:
    """Ends _steal_wake_ups' threads (each wait ends within 50 ms)."""
    stealers = getattr(raw, "stealers", None)
    if stealers:
        raw.stop_stealers.set()
        for t in stealers:
            t.join()
    raw.stealers = None


# name: (one round, pause after it (s), what it is)
RING_ATTACKS = {
    "own-claim": (_own_claim, 0.025, "claims its own ring's head and never publishes, again "
                  "after each skip (the batcher skips a stalled claim after 20 ms)"),
    "forged-claim": (_forged_claim, 0.025, "the same, the claim word naming the victim"),
    "enqueue-jump": (_enqueue_jump, 0.001, "moves its arena's enqueue_pos 10^9 ahead"),
    "ring-header": (_ring_header, 0.001, "rewrites its arena header's ring_offset and "
                    "ring_capacity"),
    "garbage-cells": (_garbage_cells, 0.001, "random words in every cell of its ring"),
    "foreign-entries": (_foreign_entries, 0.001, "publishes entries naming the victim's "
                        "client id and slots"),
}
BELL_ATTACKS = {
    "bell-moved-back": (_bell_moved_back, 0.0, "stores bell.doorbell back to one value, "
                        "in a tight loop"),
    "doorbell-loop": (_doorbell_loop, 0.0, "moves bell.doorbell and FUTEX_WAKEs it, in a loop"),
    "wake-stealer": (_steal_wake_ups, 0.01, "4 threads FUTEX_WAIT on bell.doorbell: a push "
                     "wakes one of them, not the batcher"),
}
ATTACKS = {**RING_ATTACKS, **BELL_ATTACKS}


def own_request(raw: RawLease, model_id: int, timeout: float = 10.0, slot: int = 0):
    """The attacker's own request after its attack: a valid identity request (FP32
    [1, 4]) written into `slot` and pushed once (ring_push, whatever it returns, then
    the bell). Returns (status or None if unanswered, error, push result, seconds)."""
    d = raw.data_offset + slot * 8192
    x = [1.0, 2.0, 3.0, float(slot)]
    raw.buf[d:d + 16] = struct.pack("<4f", *x)
    gen = raw.write_raw_request(slot, model_id, 1, 1, [(0, 11, 2, d, 16, (1, 4))],
                                [(0, 0, 0, d + 4096, 4096, ())])
    t0 = time.monotonic()
    rc = raw.push(slot, gen)
    answer = raw.wait_done(slot, timeout)
    took = time.monotonic() - t0
    if answer is None:
        return None, "not answered", rc, took
    status, error = answer
    if status == 0 and struct.unpack("<4f", bytes(raw.buf[d + 4096:d + 4112])) != tuple(x):
        return status, "wrong answer", rc, took
    return status, error, rc, took


def attacker(attack: str, socket_path: str, victim_id: int, ready, stop, conn=None,
             model: str = "identity") -> None:
    """Runs one attack of ATTACKS in a loop until stop is set (a spawned process: its
    own GIL and lease). Then, with conn (a Pipe end), sends back what became of its own
    request sent right after: own_request()'s tuple, plus the rounds it ran."""
    import numpy as np

    act, pause, _ = ATTACKS[attack]
    raw = RawLease(Path(socket_path))
    raw.pinned_bell = raw.bell_ops.load32(L["bell.doorbell"])
    rng = np.random.default_rng(7)
    rounds = 0
    ready.set()
    try:
        while not stop.is_set():
            for _ in range(1 if pause else 1000):  # a tight loop checks stop now and then
                act(raw, victim_id, rng)
            rounds += 1 if pause else 1000
            if pause:
                time.sleep(pause)
        stop_stealing(raw)
        if conn is not None:
            if attack in RING_ATTACKS:
                act(raw, victim_id, rng)  # the ring as the attack leaves it
            conn.send(own_request(raw, raw.model_ids[model]) + (rounds,))
    finally:
        stop_stealing(raw)
        raw.close()
