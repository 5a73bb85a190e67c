"""What scripts/fuzz_campaign.py feeds the batcher: its model table and the request
bytes it builds from the fuzzer's (a FuzzedDataProvider), hostile on purpose, each
field written where LAYOUT puts it (fuzz_reference's Fields).

Plain Python, no atheris: the campaign instruments this module when it imports it.
The `arena` arguments are the campaign's Arena (data, size, mm, layout).
"""
from __future__ import annotations

import math
import struct
import types

from fuzz_reference import (ALIGN, BYTES, DEVICE_ID, DTYPE, ELEM, FLAGS, IN0, INDEX, MAXD,
                            MAXT, MEMORY_KIND, MODEL_ID, N_INPUTS, N_OUTPUTS, NBYTES, NDIM,
                            OFFSET, OUT0, REF, REF_SIZE, REQ_SIZE, SHAPE, U32, U64)
from shmserve.protocol import DTYPE_CODES as D
from shmserve.protocol import LAYOUT as L
from shmserve.protocol import MemoryKind
from shmserve.server.repository import ModelSpec, TensorSpec

# ---------------------------------------------------------------- model table


def _spec(name, mbs, inputs, outputs, optional=(), device=False):
    """device: a pytorch model on a GPU instance, which takes device memory (kind 1)."""
    return ModelSpec(name=name, version=1, backend="pytorch" if device else "python", path="",
                     devices=(0,) if device else (), max_batch_size=mbs,
                     inputs=tuple(TensorSpec(*t, optional=k in optional)
                                  for k, t in enumerate(inputs)),
                     outputs=tuple(TensorSpec(*t) for t in outputs), instance_count=1,
                     dynamic_batching=mbs > 0, preferred_batch_sizes=(), max_queue_delay_us=0,
                     parameters={}, config_text="")


LONG = "m" * 63                       # longest model name (repository: < 64 bytes, ASCII)
UNAME = "\u20ac" * 21                  # 63 bytes of 3-byte UTF-8 characters (message cuts)
# Every fixed-size type with an element size here (BF16 needs ml_dtypes).
ALL_TYPES = [n for n, code in D.items() if code != BYTES and code in ELEM]
# Sorted by name, as load_repository orders them (the two with optional inputs last);
# every one passes repository rules (<= 16 tensors, rank + batch <= 8, dims -1 or > 0,
# names < 64 bytes).
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
    # Optional inputs (check 2's other wordings), after the sorted ones so that the
    # model ids of the corpora in tests/fuzz_corpus keep their meaning.
    _spec("optional", 4, [("REQ", D["FP32"], (-1,)), ("OPT", D["INT32"], (2,))],
          [("OUT", D["FP32"], (-1,))], optional=(1,)),
    _spec("optional_only", 4, [("A", D["FP32"], (-1,)), ("B", D["FP32"], (-1,))],
          [("OUT", D["FP32"], (-1,))], optional=(0, 1)),
    # Device memory (memory kind 1 and its CUDA IPC record's bounds), last for the same reason.
    _spec("on_gpu", 8, [("X", D["FP32"], (-1,)), ("Y", D["INT64"], (4,))],
          [("OUT", D["FP32"], (-1,)), ("OUT2", D["INT64"], (4,))], device=True),
]
READY = [m.name != "unready" for m in MODELS]
N_MODELS = len(MODELS)


def write_models(srv_ops, slay) -> None:
    """The table into a server segment (a Mapping laid out by ServerLayout `slay`),
    written by the coordinator's own write_model_entry (optional-input bits included),
    then the ready words."""
    from shmserve.server.coordinator import Coordinator

    coordinator = types.SimpleNamespace(layout=slay, server=types.SimpleNamespace(ops=srv_ops))
    for i, m in enumerate(MODELS):
        Coordinator.write_model_entry(coordinator, i, m)
        srv_ops.store32(slay.model(i) + L["model.ready"], int(READY[i]))

# ---------------------------------------------------------------- values

U64_EDGES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 255, 256, 4095, 4096,
             2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 64, 2**62, 2**63 - 64, 2**63 - 1, 2**63,
             2**64 - 64, 2**64 - 1]
I64_EDGES = [-2**63, -2**62, -2**32, -2**31, -65, -64, -2, -1, 0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 63,
             64, 65, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, 2**63 - 1]


def u64(fdp, arena) -> int:
    pick = fdp.ConsumeIntInRange(0, 5)
    if pick == 0:
        return fdp.ConsumeIntInRange(0, U64)
    if pick == 1:
        rel = [arena.data, arena.data - ALIGN, arena.data + ALIGN, arena.size - ALIGN, arena.size,
               arena.size + ALIGN, arena.layout.slots_offset, arena.size - arena.data,
               arena.size - arena.data + 1, U64 - arena.data + 1]
        return fdp.PickValueInList(rel) + fdp.ConsumeIntInRange(-2, 2) & U64
    return fdp.PickValueInList(U64_EDGES)


def i64(fdp) -> int:
    if fdp.ConsumeBool():
        return fdp.PickValueInList(I64_EDGES)
    return fdp.ConsumeIntInRange(-2**63, 2**63 - 1)


def permutation(fdp, n: int) -> list[int]:
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = fdp.ConsumeIntInRange(0, i)
        order[i], order[j] = order[j], order[i]
    return order


def bytes_payload(items: list[bytes]) -> bytes:
    """A BYTES tensor's encoding (protocol.md section 7), written out independently of
    shmserve.protocol.encode_bytes."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def place(fdp, req: bytearray, at: int) -> None:
    """Sets the tensor entry at `at` somewhere else than the caller's arena (checks 4a
    and 15a): device memory, a device named for arena memory, or any 16-bit values."""
    pick = fdp.ConsumeIntInRange(0, 3)
    if pick == 0:
        kind, device = MemoryKind.CUDA_IPC, fdp.ConsumeIntInRange(0, 7)
    elif pick == 1:
        kind, device = MemoryKind.HOST_ARENA, fdp.ConsumeIntInRange(1, DEVICE_ID.max)
    elif pick == 2:
        kind = fdp.PickValueInList([0, 1, 2, len(MemoryKind), 0x8000, MEMORY_KIND.max])
        device = fdp.PickValueInList([0, 1, 0x8000, DEVICE_ID.max])
    else:
        kind = fdp.ConsumeIntInRange(0, MEMORY_KIND.max)
        device = fdp.ConsumeIntInRange(0, DEVICE_ID.max)
    MEMORY_KIND.put(req, at, kind)
    DEVICE_ID.put(req, at, device)


# ---------------------------------------------------------------- requests


def write_ref(req: bytearray, at: int, index: int, dtype: int, shape: list[int], offset: int,
              nbytes: int) -> None:
    """A tensor entry in the caller's arena (memory kind 0, device 0)."""
    values = {"index": index, "dtype": dtype, "ndim": len(shape), "memory_kind": 0,
              "device_id": 0, "offset": offset, "nbytes": nbytes, "shape": shape}
    for name, value in values.items():
        REF[name].put(req, at, value)


def structured(fdp, arena, req: bytearray) -> None:
    """A well-formed request for a random model; inputs in random order; 1 in 8 with
    one tensor placed outside the caller's arena."""
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
            payload = bytes_payload([fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 6))
                                     for _ in range(min(count, 64))])
            nbytes = max(nbytes, len(payload))
            if cursor + len(payload) <= arena.size:
                arena.mm[cursor:cursor + len(payload)] = payload
        write_ref(req, IN0 + pos * REF_SIZE, k, s.dtype, shape, cursor, nbytes)
        cursor += max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    n_out = fdp.ConsumeIntInRange(1, len(m.outputs))
    for pos, k in enumerate(permutation(fdp, len(m.outputs))[:n_out]):
        cap = fdp.PickValueInList([0, 4, 64, 256, 1024])
        write_ref(req, OUT0 + pos * REF_SIZE, k, 0, [], cursor, cap)
        cursor += max(ALIGN, cap)
    for field, value in ((MODEL_ID, mid), (N_INPUTS, len(m.inputs)), (N_OUTPUTS, n_out),
                         (FLAGS, 0)):
        field.put(req, 0, value)
    if fdp.ConsumeIntInRange(0, 7) == 7:
        at = (IN0 + REF_SIZE * fdp.ConsumeIntInRange(0, len(m.inputs) - 1) if fdp.ConsumeBool()
              else OUT0 + REF_SIZE * fdp.ConsumeIntInRange(0, n_out - 1))
        place(fdp, req, at)


def mutate(fdp, arena, req: bytearray) -> None:
    """One field of the request set to an edge or arbitrary value."""
    what = fdp.ConsumeIntInRange(0, 12)
    k = fdp.ConsumeIntInRange(0, MAXT - 1)
    ref = IN0 + k * REF_SIZE
    if what == 0:  # header word: model_id, n_inputs, n_outputs, flags
        field = fdp.PickValueInList([MODEL_ID, N_INPUTS, N_OUTPUTS, FLAGS])
        field.put(req, 0, fdp.PickValueInList([0, 1, 2, 15, 16, 17, N_MODELS - 1, N_MODELS, 2**31,
                                               U32]) if fdp.ConsumeBool()
                  else fdp.ConsumeIntInRange(0, U32))
    elif what == 1:  # n_inputs / n_outputs +- 1
        field = fdp.PickValueInList([N_INPUTS, N_OUTPUTS])
        field.put(req, 0, (field.get(req) + fdp.PickValueInList([-1, 1])) & U32)
    elif what in (2, 3):  # input index / dtype / ndim
        field = fdp.PickValueInList([INDEX, DTYPE, NDIM])
        field.put(req, ref, fdp.ConsumeIntInRange(0, 17) if fdp.ConsumeBool()
                  else fdp.ConsumeIntInRange(0, U32))
    elif what in (4, 5):  # input offset / nbytes
        fdp.PickValueInList([OFFSET, NBYTES]).put(req, ref, u64(fdp, arena))
    elif what in (6, 7):  # input shape entry
        SHAPE.item(fdp.ConsumeIntInRange(0, MAXD - 1)).put(req, ref, i64(fdp))
    elif what == 8:  # output index / offset / capacity
        out = OUT0 + k * REF_SIZE
        field = fdp.PickValueInList([INDEX, OFFSET, NBYTES])
        if field is INDEX:
            INDEX.put(req, out, fdp.ConsumeIntInRange(0, 17) if fdp.ConsumeBool()
                      else fdp.ConsumeIntInRange(0, U32))
        else:
            field.put(req, out, u64(fdp, arena))
    elif what == 9:  # copy one tensor entry over another (duplicates, swaps)
        base = fdp.PickValueInList([IN0, OUT0])
        j = fdp.ConsumeIntInRange(0, MAXT - 1)
        req[base + j * REF_SIZE:base + (j + 1) * REF_SIZE] = \
            req[base + k * REF_SIZE:base + (k + 1) * REF_SIZE]
    elif what == 10:  # nbytes = exact size +- a little, for any shape
        shape = SHAPE.get(req, ref)[:min(NDIM.get(req, ref), MAXD)]
        n = ELEM.get(DTYPE.get(req, ref), 1) * math.prod(shape)
        NBYTES.put(req, ref, (n + fdp.ConsumeIntInRange(-4, 4)) & U64)
    elif what == 11:  # memory kind / device of an input or output entry
        place(fdp, req, fdp.PickValueInList([IN0, OUT0]) + k * REF_SIZE)
    else:  # raw bytes anywhere in the request
        at = fdp.ConsumeIntInRange(0, REQ_SIZE - 1)
        chunk = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 16))
        req[at:at + len(chunk)] = chunk[:REQ_SIZE - at]
