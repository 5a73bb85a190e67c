"""docs/protocol.md section 11 in Python, for scripts/fuzz_campaign.py.

  - the byte layout of what the campaign writes and reads back (shms_request,
    shms_tensor_ref, the slot's state words, the shadow's header): every offset and
    size comes from shmserve.protocol.LAYOUT (the C core's tables), none typed here;
  - ELEM, the element sizes of the data types (the protocol's DataType with numpy's
    itemsize; BYTES: its 4-byte length prefix);
  - decode_request(raw): a request's bytes as a dict;
  - reference(...): the status, check and message the server must answer with, check
    by check in the order of section 11 (1-20 with 4a and 15a), worded as
    shms_validate_request (shmserve/csrc/shms_request.h) words them;
  - classify(message): which check a server message reports (CHECKS).

Plain Python, no atheris: the campaign instruments this module when it imports it.
"""
from __future__ import annotations

import struct

from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L
from shmserve.protocol import DataType, MemoryKind, Status
from shmserve.server.models import INDEX_BITS, INDEX_MASK  # SHMS_MODEL_HANDLE (protocol.md: "Model handles")

MAXT, MAXD, ALIGN = P.MAX_TENSORS, P.MAX_DIMS, P.DATA_ALIGN
CUDA_IPC_BYTES = L["cuda_ipc.size"]  # a device tensor's record in the arena (kind 1)
U32, U64 = 2**32 - 1, 2**64 - 1
BYTES = int(DataType.BYTES)
ERROR_TEXT = L["ERROR_BYTES"] - 1  # the message's bytes before its NUL (snprintf cuts there)


def _elem_size(dtype: DataType) -> int | None:
    if dtype == DataType.BYTES:
        return 4  # each element's length prefix: the least an element takes
    try:
        return P.numpy_dtype(dtype).itemsize
    except TypeError:  # BF16 without ml_dtypes
        return None


# Bytes per element of every data type numpy knows here (BF16 needs ml_dtypes).
ELEM = {int(t): n for t in DataType if t != DataType.INVALID and (n := _elem_size(t))}


# ---------------------------------------------------------------- byte layout

class Field:
    """A little-endian field of a C struct where LAYOUT puts it ("struct.field" and
    "struct.field.bytes"); `count` > 1 for an array, read and written as a list."""

    def __init__(self, offset: int, size: int, signed: bool = False, count: int = 1):
        self.offset, self.size, self.signed, self.count = offset, size, signed, count
        code = {1: "b", 2: "h", 4: "i", 8: "q"}[size]
        self.fmt = struct.Struct(f"<{count}{code if signed else code.upper()}")
        self.max = 2 ** (8 * size - signed) - 1

    @classmethod
    def of(cls, key: str, signed: bool = False, count: int = 1) -> "Field":
        return cls(L[key], L[key + ".bytes"] // count, signed, count)

    def item(self, j: int) -> "Field":
        """Element j of an array field."""
        return Field(self.offset + j * self.size, self.size, self.signed)

    def get(self, buf, base: int = 0):
        values = self.fmt.unpack_from(buf, base + self.offset)
        return values[0] if self.count == 1 else list(values)

    def put(self, buf, base: int, value) -> None:
        if self.count == 1:
            self.fmt.pack_into(buf, base + self.offset, value)
        else:  # an array: the values given, then zeros
            self.fmt.pack_into(buf, base + self.offset, *value, *[0] * (self.count - len(value)))


REQ_SIZE, REF_SIZE = L["request.size"], L["tensor_ref.size"]
IN0, OUT0 = L["request.inputs"], L["request.outputs"]  # the first input / output entry
assert L["request.inputs.bytes"] == L["request.outputs.bytes"] == MAXT * REF_SIZE
MODEL_ID, N_INPUTS, N_OUTPUTS, FLAGS = (Field.of(f"request.{n}") for n in
                                        ("model_id", "n_inputs", "n_outputs", "flags"))
PARAMS_OFFSET, PARAMS_BYTES = (Field.of(f"request.{n}") for n in
                               ("parameters_offset", "parameters_bytes"))
SEQUENCE_ID, SID_OFFSET, SID_BYTES = (Field.of(f"request.{n}") for n in
                                      ("sequence_id", "sequence_id_offset", "sequence_id_bytes"))
# shms_tensor_ref, by name (the keys of decode_request's tensor dicts).
REF = {n: Field.of(f"tensor_ref.{n}") for n in
       ("index", "dtype", "ndim", "memory_kind", "device_id", "offset", "nbytes")}
REF["shape"] = Field.of("tensor_ref.shape", signed=True, count=MAXD)
INDEX, DTYPE, NDIM, MEMORY_KIND, DEVICE_ID, OFFSET, NBYTES, SHAPE = REF.values()
SLOT_STATE, SLOT_GENERATION = Field.of("slot.state"), Field.of("slot.generation")
T_NS = Field.of("slot.t_ns", count=len(P.Timestamp))
SHADOW = {n: Field.of(f"shadow.{n}") for n in ("client_id", "slot", "generation", "lease",
                                               "batch_rows")}


def decode_request(raw) -> dict:
    """A shms_request's bytes as {model_id, n_inputs, n_outputs, inputs, outputs}; the
    first n_inputs (n_outputs) entries, at most MAXT, as {field: value} (shape: all
    MAXD entries): those are all that the server reads."""
    def refs(base, n):
        return [{name: f.get(raw, base + k * REF_SIZE) for name, f in REF.items()}
                for k in range(min(n, MAXT))]

    ni, no = N_INPUTS.get(raw), N_OUTPUTS.get(raw)
    return {"model_id": MODEL_ID.get(raw), "n_inputs": ni, "n_outputs": no,
            "inputs": refs(IN0, ni), "outputs": refs(OUT0, no), "flags": FLAGS.get(raw),
            "parameters_offset": PARAMS_OFFSET.get(raw), "parameters_bytes": PARAMS_BYTES.get(raw),
            "sequence_id": SEQUENCE_ID.get(raw), "sequence_id_offset": SID_OFFSET.get(raw),
            "sequence_id_bytes": SID_BYTES.get(raw)}


# ---------------------------------------------------------------- section 11

# Which check of section 11 a server message reports (a needle of its wording), and
# the status that check answers with; NOT_FOUND and UNAVAILABLE precede the checks.
CHECKS = [
    ("1", "inputs and", Status.BAD_DESCRIPTOR), ("2", "missing input", Status.INVALID_ARG),
    ("2", "gives no input", Status.INVALID_ARG), ("3", "input index", Status.INVALID_ARG),
    ("4", "given twice", Status.INVALID_ARG), ("4a", "reads inputs from", Status.INVALID_ARG),
    ("5", "has data type", Status.INVALID_ARG), ("6", "dimensions, expected", Status.INVALID_ARG),
    ("7", "negative dimension", Status.INVALID_ARG), ("8", "outside 1..", Status.INVALID_ARG),
    ("9", "differs from", Status.INVALID_ARG), ("10", "' dimension ", Status.INVALID_ARG),
    ("11", "' data offset ", Status.BAD_DESCRIPTOR), ("11", "' data [", Status.BAD_DESCRIPTOR),
    ("12", "shape overflows", Status.INVALID_ARG),
    ("13", "its shape needs", Status.INVALID_ARG), ("14", "output index", Status.INVALID_ARG),
    ("15", "requested twice", Status.INVALID_ARG),
    ("15a", "writes outputs into", Status.INVALID_ARG),
    ("16", "' buffer offset ", Status.BAD_DESCRIPTOR), ("16", "' buffer [", Status.BAD_DESCRIPTOR),
    ("17", "names no output", Status.INVALID_ARG),
    ("18", "set unknown bits", Status.BAD_DESCRIPTOR),
    ("19", "request parameters hold", Status.INVALID_ARG),
    ("20", "request parameters [", Status.BAD_DESCRIPTOR),
    ("21", "string correlation id holds", Status.INVALID_ARG),
    ("22", "both a numeric and a string", Status.INVALID_ARG),
    ("23", "string correlation id [", Status.BAD_DESCRIPTOR),
    ("NOT_FOUND", "request names an unknown model id ", Status.NOT_FOUND),
    ("UNAVAILABLE", "is not available", Status.UNAVAILABLE),
]
STATUS_OF = {c: s for c, _, s in CHECKS}
SECTION11 = list(dict.fromkeys(c for c, _, _ in CHECKS[:-2]))  # "1", ..., "4a", ..., "17"


def classify(msg: str) -> tuple[str, Status | None]:
    """(check, its status) of the first CHECKS needle in msg; ("other", None) if none."""
    for check, needle, status in CHECKS:
        if needle in msg:
            return check, status
    return "other", None


def dtype_name(code: int) -> str:
    """shms_dtype_name: the header's name, INVALID for a code it does not list."""
    return DataType(code).name if code in DataType._value2member_map_ else "INVALID"


def tensor_bytes(dtype: int, shape: list[int]) -> int:
    """shms_tensor_bytes: ELEM x product(shape), U64 once a product would overflow."""
    n = ELEM[dtype]
    for d in shape:
        if d != 0 and n > U64 // d:
            return U64
        n *= d
    return n


def _answer(check: str, text: str) -> tuple[Status, str, str]:
    cut = text.encode()[:ERROR_TEXT].decode(errors="replace")
    return STATUS_OF[check], check, cut


def reference(req: dict, models: list, ready: list[bool], data_begin: int,
              data_end: int, generations: list[int] | None = None) -> tuple[Status, str, str]:
    """(status, check, message) of docs/protocol.md section 11 for a decoded request to
    a table of ModelSpecs: check "OK" (message ""), "NOT_FOUND", "UNAVAILABLE" or the
    first failing check of the table ("1".."23", "4a", "15a"). generations: each
    entry's handle generation (default 0, as the fuzzing tables write them)."""
    generations = generations or [0] * len(models)
    handle = req["model_id"]  # a model handle: the table index, and its generation above
    mid = handle & INDEX_MASK
    if mid >= len(models):
        return _answer("NOT_FOUND", f"request names an unknown model id {handle}")
    if handle >> INDEX_BITS != generations[mid]:
        return _answer("UNAVAILABLE", f"stale model id {handle:#x}: its model was unloaded or "
                       "reloaded; resolve the model name again")
    m = models[mid]
    if not ready[mid]:
        return _answer("UNAVAILABLE", f"model '{m.name}' version {m.version} is not ready "
                       "(it is loading, or failed to load: see `shmserve models`)")

    def refuse(check: str, text: str) -> tuple[Status, str, str]:
        return _answer(check, f"model '{m.name}': {text}")

    def placement(t: dict, check: str, name: str, noun: str) -> tuple | None:
        """Check 11 (an input's data) or 16 (an output's buffer): its offset aligned,
        then [offset, +nbytes) inside the caller's data region; in device memory (kind
        1), its CUDA IPC record's 160 bytes instead. -> refusal or None."""
        off, nb = t["offset"], t["nbytes"]
        if off % ALIGN:
            return refuse(check, f"{name} {noun} offset {off} is not a multiple of {ALIGN}")
        if t["memory_kind"] == MemoryKind.CUDA_IPC:
            noun, nb = "CUDA IPC record", CUDA_IPC_BYTES
        if off < data_begin or off > data_end or nb > data_end - off:
            return refuse(check, f"{name} {noun} [{off}, +{nb}) is outside the caller's arena")
        return None

    def entry(t: dict, side: str, seen: set) -> tuple[tuple | None, str]:
        """Checks 3, 4, 4a of an input or 14, 15, 15a of an output: its index names a
        tensor of the model, not named before, in the caller's arena.
        -> (refusal or None, "input '<name>'")."""
        specs, checks, twice = {
            "input": (m.inputs, ("3", "4", "4a"), "given"),
            "output": (m.outputs, ("14", "15", "15a"), "requested")}[side]
        k = t["index"]
        if k >= len(specs):
            return refuse(checks[0], f"{side} index {k} out of range (model has {len(specs)} "
                          f"{side}s)"), ""
        name = f"{side} '{specs[k].name}'"
        if k in seen:
            return refuse(checks[1], f"{name} {twice} twice"), name
        seen.add(k)
        kind, device = t["memory_kind"], t["device_id"]
        if not ((kind == MemoryKind.HOST_ARENA and device == 0)
                or (kind == MemoryKind.CUDA_IPC and m.device_memory)):
            takes = ("it takes kind 0 (arena, device 0) or 1 (CUDA IPC)" if m.device_memory
                     else "it takes kind 0 (arena, device 0); 1 needs KIND_GPU pytorch")
            return refuse(checks[2], f"{name} is in memory kind {kind} device {device}; "
                          f"{takes}"), name
        return None, name

    batched = m.max_batch_size > 0
    ni, no, n_in = req["n_inputs"], req["n_outputs"], len(m.inputs)
    if ni > MAXT or no > MAXT:
        return refuse("1", f"request has {ni} inputs and {no} outputs (limit {MAXT})")
    # Check 2 only when the indexes are in range and distinct (else checks 3-4 name the
    # fault): every input not marked optional is given; a batching model gets one.
    indexes = [t["index"] for t in req["inputs"][:ni]]
    if all(k < n_in for k in indexes) and len(set(indexes)) == len(indexes):
        any_optional = any(s.optional for s in m.inputs)
        missing = [s.name for k, s in enumerate(m.inputs) if k not in indexes and not s.optional]
        if missing and any_optional:
            return refuse("2", f"missing input '{missing[0]}' (it is not optional)")
        if missing:
            return refuse("2", f"missing input '{missing[0]}' (expects {n_in} inputs, got {ni})")
    if batched and ni == 0:
        return refuse("2", "request gives no input (each is optional, but one is needed for "
                      "the batch size)")
    seen, rows = set(), None
    for t in req["inputs"][:ni]:
        refusal, name = entry(t, "input", seen)
        if refusal:
            return refusal
        s = m.inputs[t["index"]]
        if t["dtype"] != s.dtype:
            return refuse("5", f"{name} has data type {dtype_name(t['dtype'])}, "
                          f"expected {dtype_name(s.dtype)}")
        ndim = len(s.dims) + batched
        if t["ndim"] != ndim:
            return refuse("6", f"{name} has {t['ndim']} dimensions, expected {ndim}"
                          + (" (batch dimension first)" if batched else ""))
        shape = t["shape"][:ndim]
        for d in shape:
            if d < 0:
                return refuse("7", f"{name} has negative dimension {d}")
        if batched:
            if not 1 <= shape[0] <= m.max_batch_size:
                return refuse("8", f"{name} batch size {shape[0]} outside 1..{m.max_batch_size}")
            if rows is not None and shape[0] != rows:
                return refuse("9", f"{name} batch size {shape[0]} differs from {rows}")
            rows = shape[0]
        for d, want in enumerate(s.dims, start=batched):
            if want >= 0 and shape[d] != want:
                return refuse("10", f"{name} dimension {d} is {shape[d]}, expected {want}")
        refusal = placement(t, "11", name, "data")
        if refusal:
            return refusal
        need = tensor_bytes(t["dtype"], shape)
        if need == U64:  # an overflow, or exactly 2^64 - 1 bytes: the C code cannot tell
            return refuse("12", f"{name} shape overflows")
        if (t["nbytes"] < need) if t["dtype"] == BYTES else (t["nbytes"] != need):
            return refuse("13", f"{name} holds {t['nbytes']} bytes, its shape needs "
                          + ("at least " if t["dtype"] == BYTES else "") + str(need))
    out_seen = set()
    for t in req["outputs"][:no]:
        refusal, name = entry(t, "output", out_seen)
        if refusal:
            return refusal
        refusal = placement(t, "16", name, "buffer")
        if refusal:
            return refusal
    if no == 0:
        return refuse("17", "request names no output buffer")
    flags, pbytes, poff = req["flags"], req["parameters_bytes"], req["parameters_offset"]
    if flags & ~(P.SEQUENCE_START | P.SEQUENCE_END | P.STREAM):
        return refuse("18", f"request flags 0x{flags:x} set unknown bits (known: SEQUENCE_START "
                      "0x1, SEQUENCE_END 0x2, STREAM 0x4)")
    if pbytes > P.MAX_PARAMETER_BYTES:
        return refuse("19", f"request parameters hold {pbytes} bytes (limit {P.MAX_PARAMETER_BYTES})")
    if pbytes and (poff < data_begin or poff > data_end or pbytes > data_end - poff):
        return refuse("20", f"request parameters [{poff}, +{pbytes}) are outside the caller's arena")
    sid, soff, sbytes = req["sequence_id"], req["sequence_id_offset"], req["sequence_id_bytes"]
    if sbytes > P.MAX_SEQUENCE_ID_BYTES:
        return refuse("21", f"the string correlation id holds {sbytes} bytes (limit "
                      f"{P.MAX_SEQUENCE_ID_BYTES})")
    if sbytes and sid:
        return refuse("22", "the request carries both a numeric and a string correlation id")
    if sbytes and (soff < data_begin or soff > data_end or sbytes > data_end - soff):
        return refuse("23", f"the string correlation id [{soff}, +{sbytes}) is outside the "
                      "caller's arena")
    return Status.OK, "OK", ""
