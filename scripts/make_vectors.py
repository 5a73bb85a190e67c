#!/usr/bin/env python3
"""Protocol test vectors: exact bytes of descriptors and control-socket frames.

Every vector is produced by the Python side's own code (shmserve._core, built from
shmserve/csrc/shmserve.h, and shmserve.protocol's msgpack framing) from the params
stored next to it. Two checks keep the clients from drifting apart:

  - tests/test_vectors.py recomputes every vector here and compares with the file;
  - the C++ client's tests (clients/cpp/tests/test_client.cpp) build the same bytes
    with the C++ encoders and compare with the file.

    python scripts/make_vectors.py            # rewrites tests/vectors/protocol_vectors.json
    python scripts/make_vectors.py --check    # exit 1 if the file differs
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shmserve import _core  # noqa: E402
from shmserve import protocol as P  # noqa: E402

OUT = ROOT / "tests" / "vectors" / "protocol_vectors.json"
L = P.LAYOUT

# The worked example of docs/protocol.md section 13.3: `simple`, model id 2.
SIMPLE_INPUTS = [(0, 8, 0x28000, 64, (1, 16)), (1, 8, 0x28040, 64, (1, 16))]
SIMPLE_OUTPUTS = [(0, 0, 0x28080, 64, ()), (1, 0, 0x280C0, 64, ())]
SIMPLE_META = {
    "id": 2, "name": "simple", "version": 1, "platform": "python", "max_batch_size": 8,
    "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
               {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]},
                {"name": "OUTPUT1", "datatype": "INT32", "shape": [-1, 16]}],
    "state": "READY", "decoupled": False}


def _request_slot(*options) -> bytearray:
    slot = bytearray(L["slot.size"])
    _core.Mapping(slot).write_request(0, 1, 2, SIMPLE_INPUTS, SIMPLE_OUTPUTS, *options)
    return slot


def tensor_ref() -> bytes:
    base = L["slot.request"] + L["request.inputs"]  # inputs[0]
    return bytes(_request_slot()[base:base + L["tensor_ref.size"]])


def request_simple() -> bytes:
    base = L["slot.request"]
    return bytes(_request_slot()[base:base + L["request.size"]])


def parameters_msgpack(parameters: dict) -> bytes:
    return P.encode_parameters(parameters)


def request_options(priority: int, timeout_us: int, parameters_offset: int, parameters: dict,
                    sequence_id: int, sequence_start: bool, sequence_end: bool) -> bytes:
    """The request of request_simple with every option set (docs/protocol.md 4.5)."""
    flags, priority, timeout_us, packed, sequence_id = P.options(
        priority, timeout_us, parameters, sequence_id, sequence_start, sequence_end)
    base = L["slot.request"]
    slot = _request_slot(flags, priority, timeout_us, parameters_offset, len(packed), sequence_id)
    return bytes(slot[base:base + L["request.size"]])


def request_string_id(sequence_id: str, sequence_id_offset: int, sequence_start: bool) -> bytes:
    """request_simple as the first request of a sequence with a string correlation id,
    its UTF-8 bytes at sequence_id_offset (docs/protocol.md 4.5.1)."""
    flags, priority, timeout_us, packed, _, string_id = P.options(
        sequence_id=sequence_id, sequence_start=sequence_start)
    base = L["slot.request"]
    slot = _request_slot(flags, priority, timeout_us, 0, 0, 0, sequence_id_offset, len(string_id))
    return bytes(slot[base:base + L["request.size"]])


def request_stream() -> bytes:
    """request_simple with the STREAM flag: the caller takes several responses."""
    base = L["slot.request"]
    slot = _request_slot(L["REQUEST_STREAM"])
    return bytes(slot[base:base + L["request.size"]])


def slot_response(status: int, index: int, results: list) -> bytes:
    """A slot of a STREAM request after the worker published response `index`
    (shms_slot_respond): its first 16 bytes (state RESPONSE, generation, status,
    n_results), results[0..n_results), then response_index, response_flags, cancel and
    stream_sleeping (16 bytes). The timestamps and the error text are left out."""
    at = L["arena.size"]  # a slot after an arena header, as the server writes it
    buf = bytearray(at + L["slot.size"])
    ops = _core.Mapping(buf)
    ops.write_request(at, 1, 2, SIMPLE_INPUTS, SIMPLE_OUTPUTS, L["REQUEST_STREAM"])
    ops.store32(at + L["slot.state"], P.SlotState.QUEUED)  # as the batcher's take leaves it
    assert ops.set_running(at, 1)
    refs = [tuple(r[:4]) + (tuple(r[4]),) for r in results]
    assert ops.respond(at, 1, status, "", refs, index)
    slot = buf[at:at + L["slot.size"]]
    res = L["slot.results"]
    words = L["slot.response_index"]
    return (bytes(slot[:16]) + bytes(slot[res:res + len(results) * L["tensor_ref.size"]])
            + bytes(slot[words:words + 16]))


def cuda_ipc_record(mem_handle: str, event_handle: str | None, offset: int, device_uuid: str) -> bytes:
    """A device tensor's shms_cuda_ipc record (docs/protocol.md 4.7) as the Python client
    writes it: gpu/ipc.py's DeviceSource.record, for a tensor `offset` bytes into its
    allocation (the export's fields set here, as _exported() would find them)."""
    from shmserve.gpu import ipc  # loads libcuda only when a device tensor is sent
    src = object.__new__(ipc.DeviceSource)
    src.base, src.handle, src.uuid = 0x7F0000000000, bytes.fromhex(mem_handle), bytes.fromhex(device_uuid)
    src.ptr = src.base + offset
    return src.record(bytes.fromhex(event_handle) if event_handle else None)


def request_device(model_id: int, inputs: list, outputs: list) -> bytes:
    """A shms_request with tensors in device memory: each ref as the Python client's
    engine builds it (_core.TensorRef with memory_kind and device_id), offset the
    tensor's record in the arena, nbytes the tensor's size (an output: its device
    buffer's capacity)."""
    base = L["slot.request"]
    slot = bytearray(L["slot.size"])
    refs = [[_core.TensorRef((i, c, o, n, tuple(s), k, d)) for i, c, o, n, s, k, d in tensors]
            for tensors in (inputs, outputs)]
    _core.Mapping(slot).write_request(0, 1, model_id, *refs)
    return bytes(slot[base:base + L["request.size"]])


def claim_word(owner: int, pos: int) -> bytes:
    # CLAIM(owner, pos), docs/protocol.md section 5; little-endian u64 as in the cell.
    return struct.pack("<Q", (1 << 63) | ((owner & 0x7FFFFFFF) << 32) | (pos & 0xFFFFFFFF))


def ring_cell_after_push(capacity: int, pos: int, owner: int, slot: int, generation: int) -> bytes:
    """The submission ring of an arena of `capacity` slots (a ring of that many cells),
    client `owner`, enqueue_pos = pos (cell free for pos); one real push through _core
    (shms_ring_push). Returns the cell then enqueue_pos."""
    buf = bytearray(_core.arena_layout(capacity, 0)[2])
    ops = _core.Mapping(buf)
    ops.init_arena(capacity, 0, owner, 1)  # cell i free for position i
    # Move the ring on to position pos, as if pos pushes had been consumed.
    enq = L["arena.enqueue_pos"]
    ops.store64(enq, pos)
    ring = P.Ring(ops)
    assert ring.capacity == capacity, ring.capacity
    cell = ring.offset + (pos & (capacity - 1)) * L["ring_cell.size"]
    ops.store64(cell + L["ring_cell.seq"], pos)
    rc = ring.push(owner, slot, generation)
    assert rc == P.RingResult.OK, rc
    size = L["ring_cell.size"]
    return bytes(buf[cell:cell + size]) + bytes(buf[enq:enq + 8])


def frame(message: dict) -> bytes:
    return P.pack_frame(message)


def bytes_tensor(items: list[str]) -> bytes:
    import numpy as np
    return P.encode_bytes(np.array([s.encode() for s in items], dtype=object))


SPECS = {
    "tensor_ref": ("shms_tensor_ref: inputs[0] of the request below (index 0, INT32, [1, 16], "
                   "offset 0x28000, 64 bytes)", tensor_ref, {}),
    "request_simple": ("shms_request of docs/protocol.md 13.3: model 2, INPUT0/INPUT1 INT32 [1, 16] "
                       "at 0x28000/0x28040, outputs 0/1 at 0x28080/0x280c0, capacity 64",
                       request_simple, {}),
    "parameters_msgpack": ("request parameters as the protocol carries them: one msgpack map, "
                           "keys in the order given (here sorted, as the C++ client packs them)",
                           parameters_msgpack,
                           {"parameters": {"flag": True, "n": 7, "tag": "cpp", "x": 1.5}}),
    "request_options": ("request_simple with options: flags SEQUENCE_START|END, priority 2, "
                        "timeout_us 1500, the parameters above at 0x28100, sequence_id 42",
                        request_options,
                        {"priority": 2, "timeout_us": 1500, "parameters_offset": 0x28100,
                         "parameters": {"flag": True, "n": 7, "tag": "cpp", "x": 1.5},
                         "sequence_id": 42, "sequence_start": True, "sequence_end": True}),
    "request_string_id": ("request_simple as a sequence's START with the string correlation id "
                          "'seq-7' (5 bytes) at 0x28100",
                          request_string_id,
                          {"sequence_id": "seq-7", "sequence_id_offset": 0x28100,
                           "sequence_start": True}),
    "request_stream": ("request_simple with flags STREAM (0x4): a stream request "
                       "(docs/protocol.md section 6a)", request_stream, {}),
    "slot_response": ("a STREAM slot after response 2 (OK) was published: state RESPONSE (5), "
                      "generation 1, status, n_results 1, results[0] = OUTPUT0 INT32 [1, 16] "
                      "at 0x28080 (64 bytes), then response_index 2, response_flags 0, "
                      "cancel 0, stream_sleeping 0", slot_response,
                      {"status": 0, "index": 2, "results": [[0, 8, 0x28080, 64, [1, 16]]]}),
    "cuda_ipc_record": ("shms_cuda_ipc (160 bytes) of an input in device memory: mem_handle "
                        "00..3f, event_handle 40..7f (flags EVENT), the tensor 0x2100 bytes into "
                        "its allocation, device_uuid a0..af",
                        cuda_ipc_record,
                        {"mem_handle": bytes(range(64)).hex(), "event_handle": bytes(range(64, 128)).hex(),
                         "offset": 0x2100, "device_uuid": bytes(range(0xA0, 0xB0)).hex()}),
    "cuda_ipc_record_output": ("the record of an output's device buffer: no event (event_handle "
                               "0, flags 0), the buffer at the allocation's base",
                               cuda_ipc_record,
                               {"mem_handle": bytes(range(64, 128)).hex(), "event_handle": None,
                                "offset": 0, "device_uuid": bytes(range(0xA0, 0xB0)).hex()}),
    "request_device": ("shms_request to model 7 with INPUT0 FP32 [1, 1024] in device memory "
                       "(memory_kind 1, device_id 1, its record at 0x28000, 4096 bytes) and "
                       "output 0 into a device buffer (kind 1, device 1, record at 0x280c0, "
                       "capacity 8192): the C++ client's layout, each record 64-aligned",
                       request_device,
                       {"model_id": 7, "inputs": [[0, 11, 0x28000, 4096, [1, 1024], 1, 1]],
                        "outputs": [[0, 0, 0x280C0, 8192, [], 1, 1]]}),
    "claim_word": ("ring cell seq while claimed: CLAIM(owner 3, pos 4097), u64 little-endian",
                   claim_word, {"owner": 3, "pos": 4097}),
    "ring_cell_after_push": ("32-byte ring cell, then enqueue_pos (u64), after push(owner 3, slot 5, "
                             "generation 7) at pos 4097 in the ring of 8 cells of an arena of 8 slots",
                             ring_cell_after_push,
                             {"capacity": 8, "pos": 4097, "owner": 3, "slot": 5, "generation": 7}),
    "hello_frame": ("hello request frame (big-endian u32 length + msgpack map)", frame,
                    {"message": {"op": "hello", "version": P.PROTOCOL_VERSION, "pid": 4242,
                                 "arena_bytes": 1048576}}),
    "metadata_frame": ("metadata request frame, version nil (= highest)", frame,
                       {"message": {"op": "metadata", "model": "simple", "version": None}}),
    "error_reply_frame": ("failed reply frame, as the server sends it (with its 'type' field)", frame,
                          {"message": {"ok": False, "code": 1,
                                       "error": "protocol version 1 not supported (server speaks 5)",
                                       "type": "ShmServeError"}}),
    "metadata_reply_frame": ("successful metadata reply frame for `simple`", frame,
                             {"message": {"ok": True, **SIMPLE_META}}),
    "bytes_tensor": ("BYTES tensor [\"ab\", \"\"]", bytes_tensor, {"items": ["ab", ""]}),
}


def build() -> dict:
    vectors = {}
    for name, (what, fn, params) in SPECS.items():
        vectors[name] = {"what": what, "params": params, "hex": fn(**params).hex()}
    return {"about": "Generated by scripts/make_vectors.py; checked by tests/test_vectors.py "
                     "and by the C++ client's tests. Do not edit by hand.",
            "vectors": vectors}


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1) + "\n"


def main() -> int:
    text = render(build())
    if "--check" in sys.argv:
        same = OUT.exists() and OUT.read_text() == text
        print("vectors up to date" if same else f"{OUT} differs from what the code produces")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
