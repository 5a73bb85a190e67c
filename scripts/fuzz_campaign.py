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

validator: builds, in process memory (anonymous mmaps wrapped by shmserve._core.Mapping),
a server segment (ServerLayout; a model table written by the coordinator's own
write_model_entry: every data type, BYTES, batched and unbatched, -1 dims, 1-16
inputs and outputs, ranks 0-8, 63-byte and non-ASCII names, one model not ready) and
two client arenas (ArenaLayout, 4 slots, 4 KiB and 64 KiB of data). Each input fills
one slot (request bytes, state and generation words, some arena header and data bytes)
from the fuzzer, either raw or as a well-formed request with a few mutated fields, and
calls Mapping.take(...) with the batcher's arguments (shmserve/server/intake.py
Batcher.take). After every call it checks, raising AssertionError on a violation:

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
    inputs are a permutation of the model's, dtype/rank/fixed dims as the model spec,
    no negative dim, nbytes = dtype size x product(shape) (BYTES: >= 4 per element),
    one batch size for all inputs in 1..max_batch_size (1 when unbatched) equal to the
    returned rows, 1..16 distinct outputs, the shape key as documented and no longer
    than the C buffer it is built in; BYTES inputs then go through decode_bytes
    (ValueError or exactly the elements of the shape);
  - every answer (status and which check failed, from the message) equals that of a
    Python reference of docs/protocol.md section 11 (checks 1-17 in their order).

The C extension is built by gcc without sanitizer coverage, so libFuzzer's coverage
comes from the instrumented Python side: shmserve modules and this harness, which
runs a distinct code block for every (model, check failed, tensor position) outcome
the C code reports, so inputs reaching a new validation outcome are kept.

decode_bytes: random and well-formed BYTES buffers (lengths mutated, truncated,
extended) with shapes of any int64 dims; only ValueError may escape, and a decoded
tensor has the shape asked for and re-encodes to exactly the buffer.
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    print(__doc__)
    sys.exit(0)

import collections
import math
import mmap
import struct
import time
import types

import atheris
import numpy as np  # noqa: F401  imported before instrumentation: not instrumented

with atheris.instrument_imports(include=["shmserve"]):
    from shmserve import _core
    from shmserve import protocol as P
    from shmserve.server.coordinator import Coordinator
    from shmserve.protocol import LAYOUT as L
    from shmserve.protocol import SlotState, Status
    from shmserve.server.repository import ModelSpec, TensorSpec
    from shmserve.server.segments import ArenaLayout, ServerLayout

D = P.DTYPE_CODES
BYTES = D["BYTES"]
ELEM = {0: 0, 1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 2, 8: 4, 9: 8, 10: 2, 11: 4, 12: 8, 13: 4, 14: 2}
MAXT, MAXD, ALIGN = P.MAX_TENSORS, P.MAX_DIMS, P.DATA_ALIGN
U32, U64 = 2**32 - 1, 2**64 - 1

# shms_request / shms_tensor_ref as struct formats, checked against the C layout.
REQ_HEAD = struct.Struct("<IIIIQQ")      # model_id n_inputs n_outputs flags client_tag reserved
REF = struct.Struct(f"<IIIIQQ{MAXD}q")   # index dtype ndim reserved offset nbytes shape[8]
assert REF.size == L["tensor_ref.size"]
assert REQ_HEAD.size + 2 * MAXT * REF.size == L["request.size"]
REQ_SIZE = L["request.size"]
IN0, OUT0 = REQ_HEAD.size, REQ_HEAD.size + MAXT * REF.size
SHADOW_HEAD = struct.Struct("<IIIIII")    # client_id slot generation lease batch_rows reserved
assert SHADOW_HEAD.size == L["shadow.request"]

# ---------------------------------------------------------------- model table


def _spec(name, mbs, inputs, outputs):
    return ModelSpec(name=name, version=1, backend="python", path="", max_batch_size=mbs,
                     inputs=tuple(TensorSpec(*t) for t in inputs),
                     outputs=tuple(TensorSpec(*t) for t in outputs), instance_count=1,
                     dynamic_batching=mbs > 0, preferred_batch_sizes=(), max_queue_delay_us=0,
                     parameters={}, config_text="")


LONG = "m" * 63                       # longest model name (repository: < 64 bytes, ASCII)
UNAME = "\u20ac" * 21                  # 63 bytes of 3-byte UTF-8 characters (message cuts)
ALL_TYPES = [n for n in D if n != "BYTES"]
# Sorted by name, as load_repository orders them; every one passes repository rules
# (<= 16 tensors, rank + batch <= 8, dims -1 or > 0, names < 64 bytes).
MODELS = [
    _spec("alltypes", 0, [(f"IN_{n}", D[n], (-1,)) for n in ALL_TYPES],
          [(f"OUT_{n}", D[n], (-1,)) for n in ALL_TYPES]),
    _spec("bytes_id", 16, [("INPUT0", BYTES, (-1,))], [("OUTPUT0", BYTES, (-1,))]),
    _spec("fixed", 0, [("A", D["FP32"], (2, 3)), ("B", D["INT64"], (4,))],
          [("X", D["FP32"], (2, 3)), ("Y", D["INT64"], (4,))]),
    _spec(LONG, 64, [(UNAME, D["UINT64"], (-1, 3)), (UNAME[:-1] + "xyz", BYTES, (2, -1))],
          [(UNAME, D["UINT64"], (-1, 3))]),
    _spec("multi", 8, [("I32", D["INT32"], (-1, 16)), ("U8", D["UINT8"], (3, -1, 2)),
                       ("H", D["FP16"], ()), ("FLAGS", D["BOOL"], (-1,)),
                       ("TEXT", BYTES, (-1, 2))],
          [("O1", D["INT32"], (-1, 16)), ("O2", D["FP16"], ()), ("O3", BYTES, (-1,))]),
    _spec("scalar", 0, [("S", D["FP64"], ())], [("T", D["FP64"], ())]),
    _spec("unready", 4, [("INPUT0", D["FP32"], (-1,))], [("OUTPUT0", D["FP32"], (-1,))]),
    _spec("wide_batched", 4, [(f"I{k}", D["INT8"], (1, -1, 1, 1, 1, -1, 1)) for k in range(16)],
          [(f"O{k}", D["INT8"], (-1,)) for k in range(16)]),
    # 16 x (1 + rank 8) = 144 shape-key entries: the largest key (tests/fuzz_corpus).
    _spec("wide_unbatched", 0, [(f"I{k}", D["INT8"], (1, -1, 1, 1, 1, 1, -1, 1))
                                for k in range(16)],
          [(f"O{k}", D["INT8"], (-1,)) for k in range(16)]),
]
READY = [m.name != "unready" for m in MODELS]
N_MODELS = len(MODELS)

MAX_CLIENTS, SLOTS = 2, 4
SLAY = ServerLayout(MAX_CLIENTS, SLOTS, N_MODELS, 1)
SRV_MM = mmap.mmap(-1, SLAY.size)
SRV = _core.Mapping(SRV_MM)
_stub = types.SimpleNamespace(layout=SLAY, server=types.SimpleNamespace(buffer=memoryview(SRV_MM)))
for _i, _m in enumerate(MODELS):
    Coordinator.write_model_entry(_stub, _i, _m)
    SRV.store32(SLAY.model(_i) + L["model.ready"], int(READY[_i]))
del _stub


class Arena:
    def __init__(self, data_bytes: int):
        self.layout = ArenaLayout.for_data(SLOTS, data_bytes)
        self.size = self.layout.segment_bytes
        self.data = self.layout.data_offset
        self.mm = mmap.mmap(-1, self.size)
        self.ops = _core.Mapping(self.mm)
        struct.pack_into("<QIIIIQQQ", self.mm, 0, L["MAGIC_ARENA"], L["PROTOCOL_VERSION"], 0, 1,
                         SLOTS, self.layout.slots_offset, self.data, self.size)
        self.header = bytes(self.mm[:L["arena.size"]])


ARENAS = [Arena(4096), Arena(65536)]


# ---------------------------------------------------------------- outcome features

# One tiny instrumented function per (model, outcome, tensor position): calling the
# one that matches an answer gives libFuzzer a new edge for every new outcome, which
# it cannot see inside the uninstrumented C code.
# Outcomes: 0 accepted, 1..17 refused by that check of protocol.md section 11,
# 18 NOT_FOUND, 19 UNAVAILABLE, 20 raised or unclassified, 21 stale (None).
OUTCOMES = 22
POSITIONS = MAXT + 1


def _make_features():
    n = (N_MODELS + 1) * OUTCOMES * POSITIONS
    src = "".join(f"def f{i}():\n    return {i}\n" for i in range(n))
    ns: dict = {}
    exec(compile(src, "<fuzz-features>", "exec"), ns)
    return [atheris.instrument_func(ns[f"f{i}"]) for i in range(n)]


FEATURES = _make_features()


OUTCOME_NAMES = (["OK"] + [f"c{i}" for i in range(1, 18)]
                 + ["NOT_FOUND", "UNAVAILABLE", "other", "stale"])
COUNTS: collections.Counter = collections.Counter()
STARTED = time.monotonic()
REPORT = {"next_exec": 1 << 16, "next_time": STARTED + 300}


def feature(model: int, outcome: int, pos: int) -> None:
    model = min(model, N_MODELS)
    FEATURES[(model * OUTCOMES + outcome) * POSITIONS + min(pos, POSITIONS - 1)]()
    COUNTS[model, outcome] += 1


def report(execs: int) -> None:
    """Outcome counts by model (c<n>: refused by check n of protocol.md section 11),
    printed at every power of two from 2^16 executions and every 5 minutes: libFuzzer
    exits without running Python's atexit."""
    now = time.monotonic()
    if execs < REPORT["next_exec"] and now < REPORT["next_time"]:
        return
    if execs >= REPORT["next_exec"]:
        REPORT["next_exec"] *= 2
    REPORT["next_time"] = now + 300
    lines = [f"fuzz_campaign: {execs} inputs in {now - STARTED:.0f} s; outcomes by model:"]
    for model in range(N_MODELS + 1):
        name = MODELS[model].name[:16] if model < N_MODELS else "(no model)"
        row = [f"{OUTCOME_NAMES[o]}={COUNTS[model, o]}" for o in range(OUTCOMES) if COUNTS[model, o]]
        if row:
            lines.append(f"  {name:16} " + " ".join(row))
    if COUNTS["decode_bytes", "ValueError"] or COUNTS["decode_bytes", "decoded"]:
        lines.append(f"  decode_bytes     decoded={COUNTS['decode_bytes', 'decoded']} "
                     f"ValueError={COUNTS['decode_bytes', 'ValueError']}")
    print("\n".join(lines), file=sys.stderr, flush=True)


# Which check of section 11 a C message reports (status it must carry).
CHECKS = [
    (1, "inputs and", Status.BAD_DESCRIPTOR), (2, "missing input", Status.INVALID_ARG),
    (2, "inputs, got", Status.INVALID_ARG), (3, "input index", Status.INVALID_ARG),
    (4, "given twice", Status.INVALID_ARG), (5, "has data type", Status.INVALID_ARG),
    (6, "dimensions, expected", Status.INVALID_ARG), (7, "negative dimension", Status.INVALID_ARG),
    (8, "outside 1..", Status.INVALID_ARG), (9, "differs from", Status.INVALID_ARG),
    (10, "' dimension ", Status.INVALID_ARG), (11, "' data [", Status.BAD_DESCRIPTOR),
    (12, "shape overflows", Status.INVALID_ARG), (13, "its shape needs", Status.INVALID_ARG),
    (14, "output index", Status.INVALID_ARG), (15, "requested twice", Status.INVALID_ARG),
    (16, "' buffer [", Status.BAD_DESCRIPTOR), (17, "names no output", Status.INVALID_ARG),
    (18, "unknown model id", Status.NOT_FOUND), (19, "is not available", Status.UNAVAILABLE),
]


@atheris.instrument_func
def classify(msg: str) -> tuple[int, Status | None]:
    for check, needle, status in CHECKS:
        if needle in msg:
            return check, status
    return 20, None


@atheris.instrument_func
def tensor_position(model: ModelSpec, msg: str) -> int:
    for k, t in enumerate(model.inputs):
        if f"input '{t.name}'" in msg:
            return k
    for k, t in enumerate(model.outputs):
        if f"output '{t.name}'" in msg:
            return k
    return MAXT


# ---------------------------------------------------------------- reference


@atheris.instrument_func
def reference(req: dict, data_begin: int, data_end: int) -> tuple[int, int]:
    """(status, check) of docs/protocol.md section 11 for a decoded request."""
    mid = req["model_id"]
    if mid >= N_MODELS:
        return Status.NOT_FOUND, 18
    if not READY[mid]:
        return Status.UNAVAILABLE, 19
    m = MODELS[mid]
    batched = m.max_batch_size > 0
    ni, no = req["n_inputs"], req["n_outputs"]
    if ni > MAXT or no > MAXT:
        return Status.BAD_DESCRIPTOR, 1
    if ni != len(m.inputs):
        return Status.INVALID_ARG, 2
    seen, rows = set(), None

    def outside(t):
        off, nb = t["offset"], t["nbytes"]
        return off % ALIGN or off < data_begin or off > data_end or nb > data_end - off

    for t in req["inputs"][:ni]:
        k = t["index"]
        if k >= len(m.inputs):
            return Status.INVALID_ARG, 3
        if k in seen:
            return Status.INVALID_ARG, 4
        seen.add(k)
        s = m.inputs[k]
        if t["dtype"] != s.dtype:
            return Status.INVALID_ARG, 5
        if t["ndim"] != len(s.dims) + batched:
            return Status.INVALID_ARG, 6
        shape = t["shape"][:t["ndim"]]
        if any(d < 0 for d in shape):
            return Status.INVALID_ARG, 7
        if batched:
            if not 1 <= shape[0] <= m.max_batch_size:
                return Status.INVALID_ARG, 8
            if rows is not None and shape[0] != rows:
                return Status.INVALID_ARG, 9
            rows = shape[0]
        for want, got in zip(s.dims, shape[batched:]):
            if want >= 0 and got != want:
                return Status.INVALID_ARG, 10
        if outside(t):
            return Status.BAD_DESCRIPTOR, 11
        n = ELEM[t["dtype"]]
        for d in shape:
            if d != 0 and n > U64 // d:
                return Status.INVALID_ARG, 12
            n *= d
        if n == U64:  # the C code's overflow marker; no status change (13 fails too)
            return Status.INVALID_ARG, 12
        if (t["nbytes"] < n) if t["dtype"] == BYTES else (t["nbytes"] != n):
            return Status.INVALID_ARG, 13
    out_seen = set()
    for t in req["outputs"][:no]:
        if t["index"] >= len(m.outputs):
            return Status.INVALID_ARG, 14
        if t["index"] in out_seen:
            return Status.INVALID_ARG, 15
        out_seen.add(t["index"])
        if outside(t):
            return Status.BAD_DESCRIPTOR, 16
    if no == 0:
        return Status.INVALID_ARG, 17
    return Status.OK, 0


def decode_request(raw: bytes) -> dict:
    mid, ni, no, flags, tag, res = REQ_HEAD.unpack_from(raw, 0)

    def refs(base):
        out = []
        for k in range(MAXT):
            f = REF.unpack_from(raw, base + k * REF.size)
            out.append({"index": f[0], "dtype": f[1], "ndim": f[2], "offset": f[4],
                        "nbytes": f[5], "shape": list(f[6:])})
        return out

    return {"model_id": mid, "n_inputs": ni, "n_outputs": no, "inputs": refs(IN0),
            "outputs": refs(OUT0)}


# ---------------------------------------------------------------- request generation

U64_EDGES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 255, 256, 4095, 4096,
             2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 64, 2**62, 2**63 - 64, 2**63 - 1, 2**63,
             2**64 - 64, 2**64 - 1]
I64_EDGES = [-2**63, -2**62, -2**32, -2**31, -65, -64, -2, -1, 0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 63,
             64, 65, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, 2**63 - 1]


@atheris.instrument_func
def u64(fdp, arena: Arena) -> int:
    pick = fdp.ConsumeIntInRange(0, 5)
    if pick == 0:
        return fdp.ConsumeIntInRange(0, U64)
    if pick == 1:
        rel = [arena.data, arena.data - ALIGN, arena.data + ALIGN, arena.size - ALIGN, arena.size,
               arena.size + ALIGN, arena.layout.slots_offset, arena.size - arena.data,
               arena.size - arena.data + 1, U64 - arena.data + 1]
        return fdp.PickValueInList(rel) + fdp.ConsumeIntInRange(-2, 2) & U64
    return fdp.PickValueInList(U64_EDGES)


@atheris.instrument_func
def i64(fdp) -> int:
    if fdp.ConsumeBool():
        return fdp.PickValueInList(I64_EDGES)
    return fdp.ConsumeIntInRange(-2**63, 2**63 - 1)


@atheris.instrument_func
def permutation(fdp, n: int) -> list[int]:
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = fdp.ConsumeIntInRange(0, i)
        order[i], order[j] = order[j], order[i]
    return order


@atheris.instrument_func
def structured(fdp, arena: Arena, req: bytearray) -> None:
    """A well-formed request for a random model; inputs in random order."""
    mid = fdp.ConsumeIntInRange(0, N_MODELS - 1)
    m = MODELS[mid]
    batched = m.max_batch_size > 0
    rows = fdp.ConsumeIntInRange(1, m.max_batch_size) if batched else 1
    cursor = arena.data
    for pos, k in enumerate(permutation(fdp, len(m.inputs))):
        s = m.inputs[k]
        shape = ([rows] if batched else []) + [fdp.ConsumeIntInRange(0, 4) if d < 0 else d
                                               for d in s.dims]
        count = math.prod(shape)
        nbytes = count * ELEM[s.dtype]
        if s.dtype == BYTES:
            items = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 6)) for _ in range(min(count, 64))]
            payload = b"".join(struct.pack("<I", len(b)) + b for b in items)
            nbytes = max(nbytes, len(payload))
            if cursor + len(payload) <= arena.size:
                arena.mm[cursor:cursor + len(payload)] = payload
        REF.pack_into(req, IN0 + pos * REF.size, k, s.dtype, len(shape), 0, cursor, nbytes,
                      *(shape + [0] * (MAXD - len(shape))))
        cursor += max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    n_out = fdp.ConsumeIntInRange(1, len(m.outputs))
    for pos, k in enumerate(permutation(fdp, len(m.outputs))[:n_out]):
        cap = fdp.PickValueInList([0, 4, 64, 256, 1024])
        REF.pack_into(req, OUT0 + pos * REF.size, k, 0, 0, 0, cursor, cap, *([0] * MAXD))
        cursor += max(ALIGN, cap)
    REQ_HEAD.pack_into(req, 0, mid, len(m.inputs), n_out, 0, 0, 0)


@atheris.instrument_func
def mutate(fdp, arena: Arena, req: bytearray) -> None:
    """One field of the request set to an edge or arbitrary value."""
    what = fdp.ConsumeIntInRange(0, 11)
    k = fdp.ConsumeIntInRange(0, MAXT - 1)
    ref = IN0 + k * REF.size
    if what == 0:  # header word: model_id, n_inputs, n_outputs, flags
        field = fdp.ConsumeIntInRange(0, 3)
        value = fdp.PickValueInList([0, 1, 2, 15, 16, 17, N_MODELS - 1, N_MODELS, 2**31, U32]) \
            if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, U32)
        struct.pack_into("<I", req, 4 * field, value)
    elif what == 1:  # n_inputs / n_outputs +- 1
        field = fdp.ConsumeIntInRange(1, 2)
        (v,) = struct.unpack_from("<I", req, 4 * field)
        struct.pack_into("<I", req, 4 * field, (v + fdp.PickValueInList([-1, 1])) & U32)
    elif what in (2, 3):  # input index / dtype / ndim
        field = fdp.ConsumeIntInRange(0, 2)
        value = fdp.ConsumeIntInRange(0, 17) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, U32)
        struct.pack_into("<I", req, ref + 4 * field, value)
    elif what in (4, 5):  # input offset / nbytes
        struct.pack_into("<Q", req, ref + 16 + 8 * fdp.ConsumeIntInRange(0, 1), u64(fdp, arena))
    elif what in (6, 7):  # input shape entry
        struct.pack_into("<q", req, ref + 32 + 8 * fdp.ConsumeIntInRange(0, MAXD - 1), i64(fdp))
    elif what == 8:  # output index / offset / capacity
        out = OUT0 + k * REF.size
        field = fdp.ConsumeIntInRange(0, 2)
        if field == 0:
            struct.pack_into("<I", req, out, fdp.ConsumeIntInRange(0, 17) if fdp.ConsumeBool()
                             else fdp.ConsumeIntInRange(0, U32))
        else:
            struct.pack_into("<Q", req, out + 8 + 8 * field, u64(fdp, arena))
    elif what == 9:  # copy one tensor entry over another (duplicates, swaps)
        base = fdp.PickValueInList([IN0, OUT0])
        j = fdp.ConsumeIntInRange(0, MAXT - 1)
        req[base + j * REF.size:base + (j + 1) * REF.size] = \
            req[base + k * REF.size:base + (k + 1) * REF.size]
    elif what == 10:  # nbytes = exact size +- a little, for any shape
        (dtype, ndim) = struct.unpack_from("<II", req, ref + 4)
        shape = struct.unpack_from(f"<{MAXD}q", req, ref + 32)[:min(ndim, MAXD)]
        n = ELEM.get(dtype, 1) * math.prod(shape)
        struct.pack_into("<Q", req, ref + 24, (n + fdp.ConsumeIntInRange(-4, 4)) & U64)
    else:  # raw bytes anywhere in the request
        at = fdp.ConsumeIntInRange(0, REQ_SIZE - 1)
        chunk = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 16))
        req[at:at + len(chunk)] = chunk[:REQ_SIZE - at]


# ---------------------------------------------------------------- target a: validator


def check(cond, what, *details):
    if not cond:
        raise AssertionError(what + ("" if not details else ": " + " ".join(map(repr, details))))


@atheris.instrument_func
def fuzz_validator(fdp) -> None:
    arena = ARENAS[fdp.ConsumeIntInRange(0, 1)]
    mm = arena.mm
    slot = fdp.ConsumeIntInRange(0, SLOTS - 1)
    client_id = fdp.ConsumeIntInRange(0, MAX_CLIENTS - 1)
    lease = fdp.ConsumeIntInRange(0, U32)
    slot_off = arena.layout.slot(slot)
    shadow_off = SLAY.shadow(client_id, slot)

    # The client's side: header, slot and some data bytes are the client's to write.
    mm[:L["arena.size"]] = arena.header
    if fdp.ConsumeIntInRange(0, 7) == 7:
        junk = fdp.ConsumeBytes(L["arena.size"])
        mm[:len(junk)] = junk
    mm[slot_off:slot_off + L["slot.size"]] = bytes(L["slot.size"])
    req = bytearray(REQ_SIZE)
    # (An exhausted FuzzedDataProvider answers 0: the usual path is the 0 one.)
    mode = fdp.ConsumeIntInRange(0, 7)
    if mode == 7:  # fully random descriptor
        raw = fdp.ConsumeBytes(REQ_SIZE)
        req[:len(raw)] = raw
    elif mode == 6:  # random tensors, plausible header
        raw = fdp.ConsumeBytes(REQ_SIZE)
        req[:len(raw)] = raw
        REQ_HEAD.pack_into(req, 0, fdp.ConsumeIntInRange(0, N_MODELS), fdp.ConsumeIntInRange(0, 17),
                           fdp.ConsumeIntInRange(0, 17), 0, 0, 0)
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
    mm[slot_off + L["slot.request"]:slot_off + L["slot.request"] + REQ_SIZE] = req
    struct.pack_into("<II", mm, slot_off + L["slot.state"], state, slot_gen)

    arena_before = bytes(mm)
    srv_before = bytes(SRV_MM)
    try:
        taken = arena.ops.take(slot_off, slot, gen, client_id, lease, SRV, shadow_off,
                               SLAY.models_offset, N_MODELS, arena.data)
    except (IndexError, ValueError) as e:  # the batcher logs these and answers nobody
        check(bytes(mm) == arena_before, "take raised after changing the slot "
              "(the request would stay QUEUED, unanswered)", type(e).__name__, str(e))
        feature(N_MODELS, 20, 0)
        return
    arena_after, srv_after = bytes(mm), bytes(SRV_MM)
    stale = state != SlotState.SUBMITTED or slot_gen != gen

    if taken is None:
        check(stale, "take returned None for a SUBMITTED slot of the right generation")
        check(arena_after == arena_before, "stale take changed the arena")
        check(srv_after == srv_before, "stale take changed the server segment")
        feature(N_MODELS, 21, 0)
        return
    check(not stale, "take claimed a slot that was not SUBMITTED with this generation",
          state, slot_gen, gen)
    check(isinstance(taken, tuple) and len(taken) in (2, 3), "take returned", taken)

    # Slot: SUBMITTED -> QUEUED, only the state word and t_ns[DEQUEUE] written.
    st_off = slot_off + L["slot.state"]
    t2 = slot_off + L["slot.t_ns"] + 8 * P.Timestamp.DEQUEUE
    check(struct.unpack_from("<I", arena_after, st_off)[0] == SlotState.QUEUED,
          "slot not QUEUED after take")
    a, b = bytearray(arena_before), bytearray(arena_after)
    for buf in (a, b):
        buf[st_off:st_off + 4] = bytes(4)
        buf[t2:t2 + 8] = bytes(8)
    check(a == b, "take wrote arena bytes other than state and t_ns[DEQUEUE]")
    # Server: only this slot's shadow.
    sh_end = shadow_off + L["shadow.size"]
    check(srv_after[:shadow_off] == srv_before[:shadow_off]
          and srv_after[sh_end:] == srv_before[sh_end:], "take wrote outside its shadow")
    sh_client, sh_slot, sh_gen, sh_lease, sh_rows, _ = SHADOW_HEAD.unpack_from(srv_after, shadow_off)
    check((sh_client, sh_slot, sh_gen, sh_lease) == (client_id, slot, gen, lease),
          "shadow header", (sh_client, sh_slot, sh_gen, sh_lease))
    shadow_req = srv_after[shadow_off + L["shadow.request"]:sh_end]
    check(shadow_req == bytes(req), "shadow is not an exact copy of the slot's request")

    decoded = decode_request(shadow_req)
    want_status, want_check = reference(decoded, arena.data, arena.size)
    mid = decoded["model_id"]
    model = MODELS[mid] if mid < N_MODELS else None

    if isinstance(taken[1], str):  # (status, message)
        status, msg = taken
        check(len(taken) == 2 and status in set(Status) and status != Status.OK,
              "unknown or OK error status", taken)
        check(msg and len(msg.encode()) < L["ERROR_BYTES"], "empty or oversized message", msg)
        check(sh_rows == 0, "batch_rows set on a refused request", sh_rows)
        got_check, check_status = classify(msg)
        if check_status is not None:
            check(status == check_status, "status does not match the check", status, msg)
        check((status, got_check) == (want_status, want_check),
              "answer differs from protocol.md section 11", (status, got_check),
              "expected", (int(want_status), want_check), msg)
        pos = tensor_position(model, msg) if model else MAXT
        feature(mid, got_check, pos)
        return

    model_id, rows, key = taken
    check(want_status == Status.OK, "accepted a request protocol.md refuses",
          (int(want_status), want_check))
    check(model_id == mid and model is not None and READY[mid], "accepted model id", model_id)
    check(rows == sh_rows, "rows differ from shadow batch_rows", rows, sh_rows)
    check_accepted(arena, model, rows, key, decoded, shadow_off)
    feature(mid, 0, min(rows, MAXT))


@atheris.instrument_func
def check_accepted(arena: Arena, m: ModelSpec, rows: int, key: bytes, req: dict,
                   shadow_off: int) -> None:
    batched = m.max_batch_size > 0
    c, s, g, lz, brows, ins, outs = SRV.read_shadow(shadow_off)
    check(brows == rows, "read_shadow rows", brows, rows)
    check(len(ins) == len(m.inputs) == req["n_inputs"], "input count", len(ins))
    check(sorted(t[0] for t in ins) == list(range(len(m.inputs))), "inputs not a permutation",
          [t[0] for t in ins])
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
            check(nbytes >= 4 * count, "BYTES input under 4 bytes per element", nbytes, shape)
            decode_checked(arena.mm[offset:offset + nbytes], shape)
        else:
            check(nbytes == ELEM[dtype] * count, "nbytes != dtype size x shape", nbytes, shape)
    check(1 <= len(outs) == req["n_outputs"] <= MAXT, "output count", len(outs))
    check(len({t[0] for t in outs}) == len(outs), "output requested twice accepted")
    for index, _, offset, nbytes, _ in outs:
        check(index < len(m.outputs), "output index", index)
        check(offset % ALIGN == 0, "output offset not aligned", offset)
        check(arena.data <= offset and offset + nbytes <= arena.size,
              "output outside [data_offset, arena size)", index, offset, nbytes, arena.size)
    # Shape key: per model input in model order, (index << 32 | ndim) then the
    # non-batch dims; built in a C array of MAX_TENSORS * (MAX_DIMS + 1) int64.
    want = []
    by_index = {t[0]: t for t in ins}
    for k in range(len(m.inputs)):
        t = by_index[k]
        want.append(k << 32 | len(t[4]))
        want.extend(t[4][batched:])
    check(len(key) <= MAXT * (MAXD + 1) * 8, "shape key overflows its C buffer "
          f"(int64 key[{MAXT * (MAXD + 1)}] in core.c m_take, {len(key) // 8} entries written)",
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
    pos = 0
    for item in out.reshape(-1):
        check(isinstance(item, bytes), "element not bytes", type(item))
        check(pos + 4 + len(item) <= len(raw), "element beyond the buffer")
        check(struct.unpack_from("<I", raw, pos)[0] == len(item)
              and raw[pos + 4:pos + 4 + len(item)] == item, "element differs from the buffer")
        pos += 4 + len(item)
    check(pos == len(raw), "decoded elements do not cover the buffer", pos, len(raw))


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
        buf = bytearray()
        for _ in range(count):
            item = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
            buf += struct.pack("<I", len(item)) + item
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
        rest.append("-max_len=8192")  # a raw request alone is 3104 bytes
    print(f"fuzz_campaign: target {TARGET}; {N_MODELS} models, arenas of "
          f"{[a.size for a in ARENAS]} bytes (data from {[a.data for a in ARENAS]})", flush=True)
    atheris.Setup(rest, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
