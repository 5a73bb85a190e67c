#!/usr/bin/env python3
"""Inputs of the C core's libFuzzer harness (tests/fuzz/shms_fuzz.c), from Python.

    python scripts/fuzz_core_inputs.py models FILE        the harness's model table
    python scripts/fuzz_core_inputs.py seeds DIR          seed corpora DIR/{take,ring,answer}
    python scripts/fuzz_core_inputs.py replay TARGET FILE|DIR ...
    python scripts/fuzz_core_inputs.py replay-edges        take_edges() through take

models: the table of scripts/fuzz_requests.py (the atheris campaign's 12 models) as the
coordinator writes it (fuzz_requests.write_models), raw shms_model_entry bytes;
scripts/fuzz_core.sh passes it to the harness as SHMS_FUZZ_MODELS.

seeds: take, well-formed requests from fuzz_requests.structured (plus mutated ones),
so that the fuzzer starts past the header checks, and take_edges (bounds just inside
and outside the caller's data); ring, honest push/consume runs;
answer, slots answered by Mapping.complete.

replay: each input through the gcc-built extension (shmserve._core), read as the
harness reads it (the formats are in shms_fuzz.c's header comment), with the same
checks; take answers are also compared with the Python reference of protocol.md
section 11 (fuzz_reference.reference). tests/test_fuzz_core.py replays
tests/fuzz_corpus/<target>/ with it in CI, where there is no clang.
"""
from __future__ import annotations

import mmap
import os
import random
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz_reference as R  # noqa: E402
from fuzz_reference import ALIGN, MAXD, MAXT, REQ_SIZE  # noqa: E402
from fuzz_requests import MODELS, N_MODELS, READY, mutate, structured, write_models  # noqa: E402

from shmserve import _core  # noqa: E402
from shmserve.protocol import LAYOUT as L  # noqa: E402
from shmserve.protocol import MemoryKind, PopResult, RingResult, SlotState, Status  # noqa: E402
from shmserve.server.segments import ArenaLayout, ServerLayout  # noqa: E402

TARGETS = ("take", "ring", "answer")
U32, U64 = 2**32 - 1, 2**64 - 1

# ---------------------------------------------------------------- take

N_SLOTS, ENTRY_GEN = 4, 7  # as shms_fuzz.c
PREFIX = 4                 # [arena, slot, state, generation], then the request


class Arena:
    """A client arena in process memory (4 slots), as shms_fuzz.c's."""

    def __init__(self, data_bytes: int):
        self.layout = ArenaLayout.for_data(N_SLOTS, data_bytes)
        self.size = self.layout.segment_bytes
        self.data = self.layout.data_offset
        self.mm = mmap.mmap(-1, self.size)
        self.ops = _core.Mapping(self.mm)
        self.ops.init_arena(N_SLOTS, data_bytes, 0, 1)


class Segments:
    """The server segment with the model table and the two arenas, built once."""

    def __init__(self):
        self.slay = ServerLayout(1, N_SLOTS, N_MODELS, 1)
        self.srv_mm = mmap.mmap(-1, self.slay.size)
        self.srv = _core.Mapping(self.srv_mm)
        self.srv.init_server(1, N_SLOTS, N_MODELS, 1)
        write_models(self.srv, self.slay)
        self.arenas = [Arena(4096), Arena(65536)]

    def model_table(self) -> bytes:
        at = self.slay.models_offset
        return bytes(self.srv_mm[at:at + N_MODELS * L["model.size"]])


_SEGMENTS: list[Segments] = []


def segments() -> Segments:
    if not _SEGMENTS:
        _SEGMENTS.append(Segments())
    return _SEGMENTS[0]


def check(cond, what, *details):
    if not cond:
        raise AssertionError(what + ("" if not details else ": " + " ".join(map(repr, details))))


def replay_take(data: bytes) -> str:
    """One take input through Mapping.take (Intake.take's call). -> the outcome: "stale",
    "OK" or the failing check of section 11 ("1".."17", "NOT_FOUND", ...)."""
    seg = segments()
    pre = data[:PREFIX].ljust(PREFIX, b"\0")
    arena = seg.arenas[pre[0] & 1]
    slot = pre[1] % N_SLOTS
    state = pre[2] & 7 if pre[2] >= 0xF0 else SlotState.SUBMITTED
    slot_gen = ENTRY_GEN + 1 if pre[3] >= 0xF0 else ENTRY_GEN
    req = data[PREFIX:PREFIX + REQ_SIZE].ljust(REQ_SIZE, b"\0")
    slot_off = arena.layout.slot(slot)
    mm = arena.mm
    mm[slot_off:slot_off + L["slot.size"]] = bytes(L["slot.size"])
    at = slot_off + L["slot.request"]
    mm[at:at + REQ_SIZE] = req
    R.SLOT_STATE.put(mm, slot_off, state)
    R.SLOT_GENERATION.put(mm, slot_off, slot_gen)
    shadow_off = seg.slay.shadow(0, slot)

    taken = arena.ops.take(slot_off, slot, ENTRY_GEN, 0, 1, seg.srv, shadow_off,
                           seg.slay.models_offset, N_MODELS, arena.data)
    stale = state != SlotState.SUBMITTED or slot_gen != ENTRY_GEN
    if taken is None:
        check(stale, "take returned None for a SUBMITTED slot of the entry's generation")
        check(R.SLOT_STATE.get(mm, slot_off) == state, "a stale take changed the slot state")
        return "stale"
    check(not stale, "take claimed a slot in state/generation", state, slot_gen)
    check(R.SLOT_STATE.get(mm, slot_off) == SlotState.QUEUED, "slot not QUEUED after take")
    shadow_req = bytes(seg.srv_mm[shadow_off + L["shadow.request"]:
                                  shadow_off + L["shadow.request"] + REQ_SIZE])
    check(shadow_req == req, "the shadow is not an exact copy of the slot's request")
    decoded = R.decode_request(req)
    want_status, want_check, want_msg = R.reference(decoded, MODELS, READY, arena.data,
                                                    arena.size)
    if isinstance(taken[1], str):
        status, msg = taken
        check(status in set(Status) - {Status.OK}, "unknown or OK error status", taken)
        check(msg and len(msg.encode()) < L["ERROR_BYTES"], "empty or oversized message", msg)
        check((status, msg) == (want_status, want_msg), "answer differs from protocol.md "
              "section 11", taken, "expected", (int(want_status), want_msg))
        return want_check
    model_id, rows, key, *options = taken
    check(tuple(options) == tuple(R.Field.of(f"request.{n}").get(req) for n in (
        "priority", "timeout_us", "parameters_offset", "parameters_bytes", "flags", "sequence_id",
        "sequence_id_offset", "sequence_id_bytes")),
        "options differ from the request's", options)
    check(want_status == Status.OK, "accepted a request protocol.md refuses", want_msg)
    m = MODELS[model_id]
    batched = m.max_batch_size > 0
    check(model_id == decoded["model_id"] and READY[model_id], "accepted model", model_id)
    check(1 <= rows <= m.max_batch_size if batched else rows == 1, "rows", rows)
    for t in decoded["inputs"] + decoded["outputs"]:
        off, nb = t["offset"], t["nbytes"]
        if t["memory_kind"] == MemoryKind.CUDA_IPC:  # its record is what lies in the arena
            check(m.device_memory, "accepted device memory for a model that takes none")
            nb = L["cuda_ipc.size"]
        check(off % ALIGN == 0 and arena.data <= off and off + nb <= arena.size,
              "accepted a tensor outside [data_offset, arena size)", off, nb)
    want_key = []
    by_index = {t["index"]: t for t in decoded["inputs"]}
    for k in range(len(m.inputs)):
        shape = by_index[k]["shape"][:by_index[k]["ndim"]]
        want_key += [k << 32 | len(shape), *shape[batched:]]
    check(len(key) <= MAXT * (MAXD + 1) * 8, "shape key overflows its C buffer", len(key))
    check(key == struct.pack(f"<{len(want_key)}q", *want_key), "shape key", key.hex())
    return "OK"


class Shim:
    """The FuzzedDataProvider calls fuzz_requests makes, from a seeded random.Random
    (no atheris needed to write seeds)."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def ConsumeIntInRange(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def ConsumeBool(self) -> bool:
        return self.r.random() < 0.5

    def ConsumeBytes(self, n: int) -> bytes:
        return self.r.randbytes(n)

    def PickValueInList(self, values):
        return self.r.choice(values)


def take_seeds(count: int = 96) -> list[bytes]:
    """Well-formed requests to every model (structured), then as many with 1-2
    mutations; prefixes of both arenas, every slot."""
    seg = segments()
    seeds = []
    for i in range(count):
        fdp = Shim(i)
        arena_index = i % 2
        req = bytearray(REQ_SIZE)
        structured(fdp, seg.arenas[arena_index], req)
        for _ in range(0 if i < count // 2 else fdp.ConsumeIntInRange(1, 2)):
            mutate(fdp, seg.arenas[arena_index], req)
        seeds.append(bytes([arena_index, i % N_SLOTS, 0, 0]) + bytes(req).rstrip(b"\0"))
    return seeds


def take_edges() -> list[bytes]:
    """Bounds at the edges of the caller's data, which an edge-minimised corpus need
    not keep (one input reaches both sides of a comparison): for a well-formed request
    to each model, its first input's and first output's (offset, nbytes) set just
    inside and just outside [data_offset, arena size), wrapping 2^64, and misaligned
    (inside and outside: the misalignment is reported first); for a model that takes
    device memory, the same entry in memory kind 1 with its 160-byte record just inside
    and outside."""
    seg = segments()
    out = []
    for mid in range(N_MODELS):
        fdp = Shim(1000 + mid)
        for arena_index, arena in enumerate(seg.arenas):
            req = bytearray(REQ_SIZE)
            while R.MODEL_ID.get(req) != mid or not R.N_OUTPUTS.get(req):
                req = bytearray(REQ_SIZE)
                structured(fdp, arena, req)
            begin, end = arena.data, arena.size
            for base in (R.IN0, R.OUT0):
                nbytes = R.NBYTES.get(req, base)
                for off, nb in ((end - ALIGN, ALIGN), (end - ALIGN, ALIGN + 1), (end, 0),
                                (end, 1), (end + ALIGN, 0), (begin - ALIGN, nbytes),
                                (begin, end - begin), (begin, end - begin + 1),
                                (U64 + 1 - ALIGN, 2 * ALIGN), (begin, U64 - begin + 1),
                                (begin + 1, nbytes), (begin + ALIGN // 2, 0), (end + 1, 0)):
                    r = bytearray(req)
                    R.OFFSET.put(r, base, off & U64)
                    R.NBYTES.put(r, base, nb & U64)
                    out.append(bytes([arena_index, mid % N_SLOTS, 0, 0]) + bytes(r))
                if MODELS[mid].device_memory:  # in device memory: its record's bounds
                    record = L["cuda_ipc.size"]
                    for off in (end - 3 * ALIGN, end - 2 * ALIGN, end - ALIGN, end,
                                begin, begin - ALIGN, end - record - ALIGN // 2):
                        r = bytearray(req)
                        R.MEMORY_KIND.put(r, base, MemoryKind.CUDA_IPC)
                        R.DEVICE_ID.put(r, base, 1)
                        R.OFFSET.put(r, base, off & U64)
                        out.append(bytes([arena_index, mid % N_SLOTS, 0, 0]) + bytes(r))
                    for kind, device in ((0, 1), (2, 0)):  # refused, by a model that takes 0 and 1
                        r = bytearray(req)
                        R.MEMORY_KIND.put(r, base, kind)
                        R.DEVICE_ID.put(r, base, device)
                        out.append(bytes([arena_index, mid % N_SLOTS, 0, 0]) + bytes(r))
    return out


# ---------------------------------------------------------------- ring

RING_CAP, OP_BYTES = 8, 14  # as shms_fuzz.c: an arena of 8 slots; opcode + 13 operand bytes
RING_ARENA = ArenaLayout.for_data(RING_CAP, 0)  # its ring: RING_CAP cells
CLAIMED = 1 << 63


def _near(v: int, cap: int) -> int:
    return v % (8 * cap + 1) - 4 * cap


def _claim_word(owner: int, pos: int) -> int:
    return CLAIMED | (owner & 0x7FFFFFFF) << 32 | pos & U32


def replay_ring(data: bytes) -> str:
    """One ring input through Mapping.ring_attach/ring_push/ring_repair/ring_pop/
    ring_skip (the client's and the batcher's calls) and stores for the vandal's
    writes. -> "refused" (a raw header ring_attach refused) or "ran"."""
    mm = mmap.mmap(-1, RING_ARENA.segment_bytes)
    ops = _core.Mapping(mm)
    ops.init_arena(RING_CAP, 0, 1, 1)
    honest, at = True, 1
    if data[:1] and data[0] & 1:
        head = data[1:1 + L["arena.size"]].ljust(L["arena.size"], b"\0")
        mm[:len(head)] = head
        at += L["arena.size"]
        try:
            off, cap = ops.ring_attach()
        except ValueError:
            return "refused"
        slots = ops.load64(L["arena.slots_offset"])
        check(L["arena.size"] <= off and off + cap * L["ring_cell.size"] <= slots
              <= RING_ARENA.segment_bytes, "attached a ring outside its place", off, cap)
        enq = L["arena.enqueue_pos"]
        ops.store64(enq, _near(ops.load64(enq), cap) & U64)  # within 4 laps, as the harness
        honest = False
    else:
        off, cap = ops.ring_attach()
        check((off, cap) == (RING_ARENA.ring_offset, RING_CAP), "fresh ring", off, cap)
    cell = L["ring_cell.size"]
    enq_at = L["arena.enqueue_pos"]
    pos, fifo = 0, []
    n_ops = 0
    while at < len(data) and n_ops < 4096:
        rec = data[at:at + OP_BYTES].ljust(OP_BYTES, b"\0")
        at += OP_BYTES
        n_ops += 1
        op, a = rec[0] % 5, rec[1:]
        if op == 0:
            rc = ops.ring_push(off, cap, a[0], a[1], a[2])
            check(rc in (RingResult.OK, RingResult.FULL), "push answered", rc)
            if honest:
                check(rc == (RingResult.OK if len(fifo) < cap else RingResult.FULL),
                      "push answered", rc, "with cells in use", len(fifo))
                if rc == RingResult.OK:
                    fifo.append((a[0], a[1], a[2]))
        elif op == 1:
            repaired = ops.ring_repair(off, cap, pos)
            check(not (honest and repaired), "repaired an honest ring")
            enq = ops.load64(enq_at)
            check((enq - pos) & U64 <= cap, "enqueue_pos after repair", enq, pos)
            got = ops.ring_pop(off, cap, pos)
            if got is not None and got[0] == PopResult.OK:
                if honest:
                    check(fifo and got[1:] == fifo[0], "popped another entry than pushed",
                          got, fifo[:1])
                    fifo.pop(0)
                pos += 1
            else:
                check(not honest or (got is None and not fifo), "honest ring: pop answered",
                      got, len(fifo))
                if got is not None and (got[0] == PopResult.CORRUPT or a[0] & 1):
                    if ops.ring_skip(off, cap, pos, got[2]):
                        pos += 1
        elif op == 2:
            v = int.from_bytes(a[1:9], "little")
            kind = a[1] % 4
            if kind == 0:
                seq = pos + _near(v, cap)
            elif kind == 1:
                seq = _claim_word(v >> 32, pos + _near(v, cap))
            elif kind == 2:
                seq = v | CLAIMED
            else:  # v, but no later than 4 laps ahead: (int64_t)(v - head) in C
                d = (v - pos) & U64
                seq = pos + 4 * cap if (d - (1 << 64) if d >> 63 else d) > 4 * cap else v
            ops.store64(off + (a[0] & (cap - 1)) * cell + L["ring_cell.seq"], seq & U64)
            honest = False
        elif op == 3:
            c = off + (a[0] & (cap - 1)) * cell
            for field, lo in (("client_id", 1), ("slot", 5), ("generation", 9)):
                ops.store32(c + L[f"ring_cell.{field}"], int.from_bytes(a[lo:lo + 4], "little"))
            honest = False
        else:
            ops.store64(enq_at, (pos + _near(int.from_bytes(a[:8], "little"), cap)) & U64)
            honest = False
    return "ran"


def ring_seeds() -> list[bytes]:
    """Honest runs: pushes and consumer steps in several rhythms, through full and
    wrapped rings; and one raw header (the fresh block's own bytes)."""
    def push(owner, slot, gen):
        return bytes([0, owner, slot, gen]) + bytes(OP_BYTES - 4)

    consume = bytes([1]) + bytes(OP_BYTES - 1)
    seeds = []
    for burst in (1, 2, 3, 8, 9):
        ops = b""
        for k in range(24):
            ops += push(k % 3, k % 8, k & 0xFF) if k % (burst + 1) != burst else consume
        seeds.append(b"\0" + ops + consume * 10)
    mm = mmap.mmap(-1, RING_ARENA.segment_bytes)
    _core.Mapping(mm).init_arena(RING_CAP, 0, 1, 1)
    seeds.append(b"\1" + bytes(mm[:L["arena.size"]]) + push(1, 2, 3) + consume)
    return seeds


# ---------------------------------------------------------------- answer

def replay_answer(data: bytes) -> str:
    """A DONE slot's bytes through Mapping.read_result. -> the status's name or number."""
    lay = ArenaLayout.for_data(1, 0)
    mm = mmap.mmap(-1, lay.segment_bytes)
    ops = _core.Mapping(mm)
    ops.init_arena(1, 0, 0, 1)
    s = lay.slot(0)
    raw = data[:L["slot.size"]].ljust(L["slot.size"], b"\0")
    mm[s:s + L["slot.size"]] = raw
    R.SLOT_STATE.put(mm, s, SlotState.DONE)
    got = ops.read_result(s)
    check(got is not None, "a DONE slot read as not done")
    status, msg, results, _ = got
    want_status = struct.unpack_from("<i", raw, L["slot.status"])[0]
    check(status == want_status, "status", status, want_status)
    check(len(results) <= MAXT, "results", len(results))
    check(not results or status in (Status.OK, Status.OUTPUT_TOO_SMALL),
          "results with status", status)
    err = raw[L["slot.error"]:L["slot.error"] + L["ERROR_BYTES"]].split(b"\0")[0]
    check(msg == err[:L["ERROR_BYTES"] - 1].decode(errors="replace"), "message", msg)
    check(R.SLOT_STATE.get(mm, s) == SlotState.FREE, "slot not FREE after read_result")
    return Status(status).name if status in set(Status) else str(status)


def answer_seeds() -> list[bytes]:
    lay = ArenaLayout.for_data(1, 0)
    seeds = []
    for status, n in ((Status.OK, 1), (Status.OK, 16), (Status.OUTPUT_TOO_SMALL, 2),
                      (Status.INVALID_ARG, 0), (Status.INTERNAL, 0)):
        mm = mmap.mmap(-1, lay.segment_bytes)
        ops = _core.Mapping(mm)
        ops.init_arena(1, 0, 0, 1)
        s = lay.slot(0)
        R.SLOT_STATE.put(mm, s, SlotState.QUEUED)
        results = [(k, 11, lay.data_offset, 4 * (k + 1), [k + 1]) for k in range(n)]
        ops.complete(s, 0, status, "" if status == Status.OK else f"{status.name}: \u20ac x",
                     results)
        seeds.append(bytes(mm[s:s + L["slot.size"]]).rstrip(b"\0"))
    return seeds


# ---------------------------------------------------------------- command line

REPLAY = {"take": replay_take, "ring": replay_ring, "answer": replay_answer}
SEEDS = {"take": lambda: take_seeds() + take_edges(), "ring": ring_seeds,
         "answer": answer_seeds}


def corpus_files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(os.path.join(p, f) for f in os.listdir(p)
                          if os.path.isfile(os.path.join(p, f)) and not f.startswith("."))
        else:
            out.append(p)
    return out


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "models":
        with open(argv[1], "wb") as f:
            f.write(segments().model_table())
        return 0
    if len(argv) == 2 and argv[0] == "seeds":
        for target in TARGETS:
            d = os.path.join(argv[1], target)
            os.makedirs(d, exist_ok=True)
            for i, seed in enumerate(SEEDS[target]()):
                with open(os.path.join(d, f"seed-{i:03d}"), "wb") as f:
                    f.write(seed)
        return 0
    if len(argv) >= 3 and argv[0] == "replay" and argv[1] in REPLAY:
        counts: dict = {}
        files = corpus_files(argv[2:])
        for path in files:
            with open(path, "rb") as f:
                outcome = REPLAY[argv[1]](f.read())
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"replayed {len(files)} {argv[1]} inputs: {dict(sorted(counts.items()))}")
        return 0
    if argv == ["replay-edges"]:
        counts = {}
        for data in take_edges():
            outcome = replay_take(data)
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"replayed {sum(counts.values())} take edges: {dict(sorted(counts.items()))}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
