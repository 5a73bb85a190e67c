#!/usr/bin/env python3
"""In-process atheris fuzz campaign of shmserve's request validation (no server).

    python scripts/fuzz_campaign.py [--target=validator|decode_bytes|all] [libFuzzer flags] [CORPUS_DIR | FILE ...]

    python scripts/fuzz_campaign.py -max_total_time=600               # both targets, 10 minutes
    python scripts/fuzz_campaign.py --target=validator -max_total_time=900 /tmp/corpus-validator
    python scripts/fuzz_campaign.py --target=validator tests/fuzz_corpus/<reproducer>   # replay one input

Needs atheris (`pip install -e '.[fuzz]'`). Everything that is not one of the options
below is handed to libFuzzer (-max_total_time, -runs, -seed, -artifact_prefix, -jobs,
-help=1, corpus directories, single inputs to replay). Run one process at a time.

Options:
  --target=T   validator     the batcher's take + shms_validate_request
               decode_bytes  shmserve.protocol.decode_bytes, as the worker calls it
               all           both; each input picks one, decode_bytes 1 in 8 (default)
  -h, --help   this text

Its parts: this file (the segments, the targets, the checks, the driver);
scripts/fuzz_requests.py (the model table and the requests built from the fuzzer's
bytes); scripts/fuzz_reference.py (docs/protocol.md section 11 in Python, and the
request's byte layout, every offset and size from shmserve.protocol.LAYOUT).

validator: builds, in process memory (anonymous mmaps wrapped by shmserve._core.Mapping),
a server segment (ServerLayout, header by Mapping.init_server; a model table written
by the coordinator's write_model_entry: every data type, BYTES, batched and unbatched,
-1 dims, 1-16 inputs and outputs, ranks 0-8, 63-byte and non-ASCII names, optional
inputs, one model not ready)
and two client arenas (ArenaLayout, header by Mapping.init_arena, 4 slots, 4 KiB and
64 KiB of data). Each input fills one slot (request bytes, state and generation words,
some arena header and data bytes) from the fuzzer, either raw or as a well-formed
request (1 in 8 with one tensor's memory_kind/device_id not the caller's arena) with a
few mutated fields, and calls Mapping.take(...) with the batcher's arguments
(shmserve/server/intake.py Batcher.take). After every call it checks, raising
AssertionError on a violation:

  - take returns None, (status, message) with a known non-OK status and a non-empty
    message of at most 255 bytes, or (model_id, rows, shape_key); any exception but
    IndexError/ValueError (what the batcher catches) escapes and is a finding, and
    those two must leave the slot as it was (else the request would stay QUEUED with
    nobody to answer it);
  - slot states: None iff the slot was not SUBMITTED with the entry's generation, and
    then nothing changed; otherwise SUBMITTED -> QUEUED and the only bytes written are
    the state word, t_ns[DEQUEUE] and the shadow of (client, slot): header fields as
    passed, request an exact copy of the slot's, batch_rows 0 on error;
  - accepted requests (read back with read_shadow and raw from the shadow): every
    input and output lies wholly inside [data_offset, arena size), offsets 64-aligned,
    in memory kind 0 on device 0, inputs are a permutation of the model's,
    dtype/rank/fixed dims as the model spec, no negative dim, nbytes = dtype size x
    product(shape) (BYTES: >= 4 per element), one batch size for all inputs in
    1..max_batch_size (1 when unbatched) equal to the returned rows, 1..16 distinct
    outputs, the shape key as documented and no longer than the C buffer it is built
    in; BYTES inputs then go through decode_bytes (ValueError or exactly the elements
    of the shape);
  - every answer equals that of the Python reference of docs/protocol.md section 11
    (NOT_FOUND, UNAVAILABLE, then checks 1-17 with 4a and 15a in their order): the
    status, which check failed (read from the message) and the message itself.

The C extension is built by gcc without sanitizer coverage, so libFuzzer's coverage
comes from the instrumented Python side: shmserve modules and these three scripts,
which run a distinct code block for every (model, check failed, tensor position)
outcome the C code reports, so inputs reaching a new validation outcome are kept.

decode_bytes: random and well-formed BYTES buffers (lengths mutated, truncated,
extended) with shapes of any int64 dims; only ValueError may escape, and a decoded
tensor has the shape asked for and re-encodes to exactly the buffer.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    print(__doc__)
    sys.exit(0)

import collections
import math
import mmap
import struct
import time

import atheris
import numpy as np  # noqa: F401  imported before instrumentation: not instrumented

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its parts, when imported
with atheris.instrument_imports(include=["shmserve", "fuzz_reference", "fuzz_requests"]):
    from shmserve import _core
    from shmserve import protocol as P
    from shmserve.protocol import LAYOUT as L
    from shmserve.protocol import SlotState, Status
    from shmserve.server.repository import ModelSpec
    from shmserve.server.segments import ArenaLayout, ServerLayout

    import fuzz_reference as R
    from fuzz_reference import ALIGN, BYTES, ELEM, MAXD, MAXT, SHADOW, SLOT_STATE, U32
    from fuzz_requests import (MODELS, N_MODELS, READY, bytes_payload, i64, mutate,
                               structured, write_models)

# ---------------------------------------------------------------- segments

MAX_CLIENTS, SLOTS = 2, 4
SLAY = ServerLayout(MAX_CLIENTS, SLOTS, N_MODELS, 1)
SRV_MM = mmap.mmap(-1, SLAY.size)
SRV = _core.Mapping(SRV_MM)
SRV.init_server(MAX_CLIENTS, SLOTS, N_MODELS, 1)
write_models(SRV, SLAY)  # by the coordinator's write_model_entry


class Arena:
    def __init__(self, data_bytes: int):
        self.layout = ArenaLayout.for_data(SLOTS, data_bytes)
        self.size = self.layout.segment_bytes
        self.data = self.layout.data_offset
        self.mm = mmap.mmap(-1, self.size)
        self.ops = _core.Mapping(self.mm)
        self.ops.init_arena(SLOTS, data_bytes, 0, 1)  # client 0, generation 1
        self.header = bytes(self.mm[:L["arena.size"]])


ARENAS = [Arena(4096), Arena(65536)]


# ---------------------------------------------------------------- outcome features

# One tiny instrumented function per (model, outcome, tensor position): calling the
# one that matches an answer gives libFuzzer a new edge for every new outcome, which
# it cannot see inside the uninstrumented C code.
# Outcomes: accepted, refused by a check of protocol.md section 11 (c<check>),
# NOT_FOUND, UNAVAILABLE, raised or unclassified, stale (None).
OUTCOME_NAMES = ["OK", *(f"c{c}" for c in R.SECTION11), "NOT_FOUND", "UNAVAILABLE", "other",
                 "stale"]
OUTCOME = {name: i for i, name in enumerate(OUTCOME_NAMES)}
OUTCOMES = len(OUTCOME_NAMES)
POSITIONS = MAXT + 1


def _make_features():
    n = (N_MODELS + 1) * OUTCOMES * POSITIONS
    src = "".join(f"def f{i}():\n    return {i}\n" for i in range(n))
    ns: dict = {}
    exec(compile(src, "<fuzz-features>", "exec"), ns)
    return [atheris.instrument_func(ns[f"f{i}"]) for i in range(n)]


FEATURES = _make_features()
COUNTS: collections.Counter = collections.Counter()
STARTED = time.monotonic()
REPORT = {"next_exec": 1 << 16, "next_time": STARTED + 300}


def feature(model: int, outcome: str, pos: int) -> None:
    """outcome: an OUTCOME_NAMES entry, or a check of section 11 ("4a")."""
    model = min(model, N_MODELS)
    o = OUTCOME[outcome if outcome in OUTCOME else f"c{outcome}"]
    FEATURES[(model * OUTCOMES + o) * POSITIONS + min(pos, POSITIONS - 1)]()
    COUNTS[model, o] += 1


def report(execs: int, force: bool = False) -> None:
    """Outcome counts by model (c<n>: refused by check n of protocol.md section 11),
    printed at every power of two from 2^16 executions and every 5 minutes: libFuzzer
    exits without running Python's atexit."""
    now = time.monotonic()
    if execs < REPORT["next_exec"] and now < REPORT["next_time"] and not force:
        return
    while execs >= REPORT["next_exec"]:
        REPORT["next_exec"] *= 2
    REPORT["next_time"] = now + 300
    lines = [f"fuzz_campaign: {execs} inputs in {now - STARTED:.0f} s; outcomes by model:"]
    for model in range(N_MODELS + 1):
        name = MODELS[model].name[:16] if model < N_MODELS else "(no model)"
        row = [f"{name}={COUNTS[model, o]}" for o, name in enumerate(OUTCOME_NAMES)
               if COUNTS[model, o]]
        if row:
            lines.append(f"  {name:16} " + " ".join(row))
    if COUNTS["decode_bytes", "ValueError"] or COUNTS["decode_bytes", "decoded"]:
        lines.append(f"  decode_bytes     decoded={COUNTS['decode_bytes', 'decoded']} "
                     f"ValueError={COUNTS['decode_bytes', 'ValueError']}")
    print("\n".join(lines), file=sys.stderr, flush=True)


@atheris.instrument_func
def tensor_position(model: ModelSpec, msg: str) -> int:
    for k, t in enumerate(model.inputs):
        if f"input '{t.name}'" in msg:
            return k
    for k, t in enumerate(model.outputs):
        if f"output '{t.name}'" in msg:
            return k
    return MAXT


# ---------------------------------------------------------------- target a: validator


def check(cond, what, *details):
    if not cond:
        raise AssertionError(what + ("" if not details else ": " + " ".join(map(repr, details))))


@atheris.instrument_func
def fill_slot(fdp, arena: Arena, slot_off: int) -> tuple[bytearray, int, int, int]:
    """The client's side: the arena header, the slot and some data bytes are the
    client's to write. -> (request bytes, state, slot generation, entry generation)."""
    mm = arena.mm
    mm[:L["arena.size"]] = arena.header
    if fdp.ConsumeIntInRange(0, 7) == 7:
        junk = fdp.ConsumeBytes(L["arena.size"])
        mm[:len(junk)] = junk
    mm[slot_off:slot_off + L["slot.size"]] = bytes(L["slot.size"])
    req = bytearray(R.REQ_SIZE)
    # (An exhausted FuzzedDataProvider answers 0: the usual path is the 0 one.)
    mode = fdp.ConsumeIntInRange(0, 7)
    if mode == 7:  # fully random descriptor
        raw = fdp.ConsumeBytes(R.REQ_SIZE)
        req[:len(raw)] = raw
    elif mode == 6:  # random tensors, plausible header (the reserved words stay random)
        raw = fdp.ConsumeBytes(R.REQ_SIZE)
        req[:len(raw)] = raw
        for field, top in ((R.MODEL_ID, N_MODELS), (R.N_INPUTS, 17), (R.N_OUTPUTS, 17)):
            field.put(req, 0, fdp.ConsumeIntInRange(0, top))
        R.FLAGS.put(req, 0, 0)
        R.PARAMS_BYTES.put(req, 0, 0)  # no parameters: the tensors' checks are the target
    else:  # well formed, then 0-4 mutations
        structured(fdp, arena, req)
        for _ in range(fdp.ConsumeIntInRange(0, 4) if mode else 0):
            mutate(fdp, arena, req)
    if fdp.ConsumeIntInRange(0, 3) == 3:  # some data bytes too (never read by take)
        at = arena.data + ALIGN * fdp.ConsumeIntInRange(0, (arena.size - arena.data) // ALIGN - 1)
        chunk = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 256))
        mm[at:at + len(chunk)] = chunk[:arena.size - at]
    gen = fdp.ConsumeIntInRange(0, U32)
    state_pick = fdp.ConsumeIntInRange(0, 15)
    state = (fdp.ConsumeIntInRange(0, U32) if state_pick == 15 else
             fdp.ConsumeIntInRange(0, 4) if state_pick == 14 else SlotState.SUBMITTED)
    slot_gen = fdp.ConsumeIntInRange(0, U32) if state_pick == 13 else gen
    at = slot_off + L["slot.request"]
    mm[at:at + R.REQ_SIZE] = req
    SLOT_STATE.put(mm, slot_off, state)
    R.SLOT_GENERATION.put(mm, slot_off, slot_gen)
    return req, state, slot_gen, gen


@atheris.instrument_func
def fuzz_validator(fdp) -> None:
    arena = ARENAS[fdp.ConsumeIntInRange(0, 1)]
    mm = arena.mm
    slot = fdp.ConsumeIntInRange(0, SLOTS - 1)
    client_id = fdp.ConsumeIntInRange(0, MAX_CLIENTS - 1)
    lease = fdp.ConsumeIntInRange(0, U32)
    slot_off = arena.layout.slot(slot)
    shadow_off = SLAY.shadow(client_id, slot)
    req, state, slot_gen, gen = fill_slot(fdp, arena, slot_off)

    arena_before = bytes(mm)
    srv_before = bytes(SRV_MM)
    try:
        taken = arena.ops.take(slot_off, slot, gen, client_id, lease, SRV, shadow_off,
                               SLAY.models_offset, N_MODELS, arena.data)
    except (IndexError, ValueError) as e:  # the batcher logs these and answers nobody
        check(bytes(mm) == arena_before, "take raised after changing the slot "
              "(the request would stay QUEUED, unanswered)", type(e).__name__, str(e))
        feature(N_MODELS, "other", 0)
        return
    arena_after, srv_after = bytes(mm), bytes(SRV_MM)
    stale = state != SlotState.SUBMITTED or slot_gen != gen

    if taken is None:
        check(stale, "take returned None for a SUBMITTED slot of the right generation")
        check(arena_after == arena_before, "stale take changed the arena")
        check(srv_after == srv_before, "stale take changed the server segment")
        feature(N_MODELS, "stale", 0)
        return
    check(not stale, "take claimed a slot that was not SUBMITTED with this generation",
          state, slot_gen, gen)
    check(isinstance(taken, tuple) and len(taken) in (2, 7), "take returned", taken)

    # Slot: SUBMITTED -> QUEUED, only the state word and t_ns[DEQUEUE] written.
    t2 = R.T_NS.item(P.Timestamp.DEQUEUE)
    check(SLOT_STATE.get(arena_after, slot_off) == SlotState.QUEUED, "slot not QUEUED after take")
    a, b = bytearray(arena_before), bytearray(arena_after)
    for buf in (a, b):
        SLOT_STATE.put(buf, slot_off, 0)
        t2.put(buf, slot_off, 0)
    check(a == b, "take wrote arena bytes other than state and t_ns[DEQUEUE]")
    # Server: only this slot's shadow.
    sh_end = shadow_off + L["shadow.size"]
    check(srv_after[:shadow_off] == srv_before[:shadow_off]
          and srv_after[sh_end:] == srv_before[sh_end:], "take wrote outside its shadow")
    head = {name: f.get(srv_after, shadow_off) for name, f in SHADOW.items()}
    check(head == {"client_id": client_id, "slot": slot, "generation": gen, "lease": lease,
                   "batch_rows": head["batch_rows"]}, "shadow header", head)
    shadow_req = srv_after[shadow_off + L["shadow.request"]:sh_end]
    check(shadow_req == bytes(req), "shadow is not an exact copy of the slot's request")

    decoded = R.decode_request(shadow_req)
    want_status, want_check, want_msg = R.reference(decoded, MODELS, READY, arena.data,
                                                    arena.size)
    mid = decoded["model_id"]
    model = MODELS[mid] if mid < N_MODELS else None

    if isinstance(taken[1], str):  # (status, message)
        status, msg = taken
        check(len(taken) == 2 and status in set(Status) and status != Status.OK,
              "unknown or OK error status", taken)
        check(msg and len(msg.encode()) < L["ERROR_BYTES"], "empty or oversized message", msg)
        check(head["batch_rows"] == 0, "batch_rows set on a refused request", head["batch_rows"])
        got_check, check_status = R.classify(msg)
        if check_status is not None:
            check(status == check_status, "status does not match the check", status, msg)
        check((status, got_check) == (want_status, want_check),
              "answer differs from protocol.md section 11", (status, got_check),
              "expected", (int(want_status), want_check), msg)
        check(msg == want_msg, "message differs from shms_validate_request's wording", msg,
              "expected", want_msg)
        feature(mid, got_check, tensor_position(model, msg) if model else MAXT)
        return

    model_id, rows, key, priority, timeout_us, params_off, params_bytes = taken
    check((priority, timeout_us, params_off, params_bytes) ==
          tuple(R.Field.of(f"request.{n}").get(shadow_req) for n in
                ("priority", "timeout_us", "parameters_offset", "parameters_bytes")),
          "options differ from the shadow's", taken)
    check(want_status == Status.OK, "accepted a request protocol.md refuses",
          (int(want_status), want_check, want_msg))
    check(model_id == mid and model is not None and READY[mid], "accepted model id", model_id)
    check(rows == head["batch_rows"], "rows differ from shadow batch_rows", rows, head)
    check_accepted(arena, model, rows, key, decoded, shadow_off)
    feature(mid, "OK", min(rows, MAXT))


@atheris.instrument_func
def check_accepted(arena: Arena, m: ModelSpec, rows: int, key: bytes, req: dict,
                   shadow_off: int) -> None:
    batched = m.max_batch_size > 0
    c, s, g, lz, brows, ins, outs, _ = SRV.read_shadow(shadow_off)
    check(brows == rows, "read_shadow rows", brows, rows)
    check(len(ins) == len(m.inputs) == req["n_inputs"], "input count", len(ins))
    check(sorted(t.index for t in ins) == list(range(len(m.inputs))), "inputs not a permutation",
          [t.index for t in ins])
    check(all(t.memory_kind == 0 and t.device_id == 0 for t in ins + outs),
          "accepted a tensor outside the caller's arena (memory kind, device)", ins + outs)
    if batched:
        check(1 <= rows <= m.max_batch_size, "rows outside 1..max_batch_size", rows)
    else:
        check(rows == 1, "unbatched rows", rows)
    for (index, dtype, offset, nbytes, shape), raw in zip(ins, req["inputs"]):
        spec = m.inputs[index]
        ndim = raw["ndim"]
        check(ndim == len(spec.dims) + batched <= MAXD, "rank", spec.name, ndim)
        check(list(shape) == raw["shape"][:ndim], "read_shadow shape", shape)
        check(dtype == spec.dtype, "dtype", spec.name, dtype)
        check(all(d >= 0 for d in shape), "negative dim accepted", shape)
        if batched:
            check(shape[0] == rows, "batch dim differs from rows", shape, rows)
        for want, got in zip(spec.dims, shape[batched:]):
            check(want < 0 or got == want, "dim differs from the model's", spec.name, shape)
        check(offset % ALIGN == 0, "input offset not aligned", offset)
        check(arena.data <= offset and offset + nbytes <= arena.size,
              "input outside [data_offset, arena size)", spec.name, offset, nbytes, arena.size)
        count = math.prod(shape)
        if dtype == BYTES:
            check(nbytes >= ELEM[BYTES] * count, "BYTES input under 4 bytes per element",
                  nbytes, shape)
            decode_checked(arena.mm[offset:offset + nbytes], shape)
        else:
            check(nbytes == ELEM[dtype] * count, "nbytes != dtype size x shape", nbytes, shape)
    check(1 <= len(outs) == req["n_outputs"] <= MAXT, "output count", len(outs))
    check(len({t.index for t in outs}) == len(outs), "output requested twice accepted")
    for index, _, offset, nbytes, _ in outs:
        check(index < len(m.outputs), "output index", index)
        check(offset % ALIGN == 0, "output offset not aligned", offset)
        check(arena.data <= offset and offset + nbytes <= arena.size,
              "output outside [data_offset, arena size)", index, offset, nbytes, arena.size)
    # Shape key: per model input in model order, (index << 32 | ndim) then the
    # non-batch dims; built in a C array of MAX_TENSORS * (MAX_DIMS + 1) int64.
    want = []
    by_index = {t.index: t for t in ins}
    for k in range(len(m.inputs)):
        shape = by_index[k].shape
        want.append(k << 32 | len(shape))
        want.extend(shape[batched:])
    check(len(key) <= MAXT * (MAXD + 1) * 8, "shape key overflows its C buffer "
          f"(int64 key[{MAXT * (MAXD + 1)}] in shms_shape_key, {len(key) // 8} entries written)",
          m.name, len(key))
    check(key == struct.pack(f"<{len(want)}q", *want), "shape key", key.hex())


# ---------------------------------------------------------------- target b: decode_bytes


@atheris.instrument_func
def decode_checked(buf, shape) -> None:
    """decode_bytes must raise ValueError or return exactly the buffer's elements."""
    try:
        out = P.decode_bytes(buf, shape)
    except ValueError:
        COUNTS["decode_bytes", "ValueError"] += 1
        return
    COUNTS["decode_bytes", "decoded"] += 1
    raw = bytes(buf)
    check(out.shape == tuple(int(d) for d in shape), "decoded shape", out.shape, shape)
    items = list(out.reshape(-1))
    check(all(isinstance(item, bytes) for item in items), "element not bytes")
    check(bytes_payload(items) == raw, "decoded elements differ from the buffer", len(raw))


@atheris.instrument_func
def fuzz_decode_bytes(fdp) -> None:
    rank = fdp.ConsumeIntInRange(0, 4)
    shape = [fdp.ConsumeIntInRange(0, 4) if fdp.ConsumeIntInRange(0, 5) else i64(fdp)
             for _ in range(rank)]
    mode = fdp.ConsumeIntInRange(0, 3)
    count = math.prod(shape) if all(0 <= d <= 64 for d in shape) else 0
    if mode == 0 or count > 256:
        buf = bytearray(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 512)))
    else:
        buf = bytearray(bytes_payload([fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
                                       for _ in range(count)]))
        for _ in range(fdp.ConsumeIntInRange(0, 3) if mode > 1 else 0):
            op = fdp.ConsumeIntInRange(0, 3)
            if op == 0 and len(buf) >= 4:  # a length word anywhere
                at = fdp.ConsumeIntInRange(0, len(buf) - 4)
                struct.pack_into("<I", buf, at, fdp.PickValueInList([0, 1, 3, 4, 255, 2**31, U32])
                                 if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, U32))
            elif op == 1 and buf:
                del buf[fdp.ConsumeIntInRange(0, len(buf) - 1):]
            elif op == 2:
                buf += fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
            elif buf:
                buf[fdp.ConsumeIntInRange(0, len(buf) - 1)] = fdp.ConsumeIntInRange(0, 255)
    # The worker passes a memoryview slice of the arena mapping.
    decode_checked(memoryview(bytes(buf)), shape)


# ---------------------------------------------------------------- entry point

TARGET = "all"
EXECS = [0]


def TestOneInput(data: bytes) -> None:
    EXECS[0] += 1
    report(EXECS[0])
    fdp = atheris.FuzzedDataProvider(data)
    if TARGET == "validator":
        fuzz_validator(fdp)
    elif TARGET == "decode_bytes":
        fuzz_decode_bytes(fdp)
    elif fdp.ConsumeIntInRange(0, 7) == 7:
        fuzz_decode_bytes(fdp)
    else:
        fuzz_validator(fdp)


def main(argv: list[str]) -> None:
    global TARGET
    # libFuzzer ignores arguments that start with "--" but keeps them for the
    # processes it starts itself (-minimize_crash, -fork, -jobs).
    rest = list(argv)
    for arg in argv[1:]:
        if arg.startswith("--target="):
            TARGET = arg.split("=", 1)[1]
            if TARGET not in ("validator", "decode_bytes", "all"):
                sys.exit(f"unknown --target {TARGET!r} (validator, decode_bytes, all)")
        elif arg.startswith("--"):
            sys.exit(f"unknown option {arg} (see --help)")
    if not any(a.startswith("-max_len=") for a in rest):
        rest.append("-max_len=8192")  # a raw request alone is 3136 bytes
    missing = [t.name for t in P.DataType if t != P.DataType.INVALID and t not in ELEM]
    print(f"fuzz_campaign: target {TARGET}; {N_MODELS} models, arenas of "
          f"{[a.size for a in ARENAS]} bytes (data from {[a.data for a in ARENAS]})"
          + (f"; left out, no numpy type here: {missing}" if missing else ""), flush=True)
    atheris.Setup(rest, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
