"""Protocol test vectors (tests/vectors/protocol_vectors.json): the Python side
recomputes every vector and must get the same bytes; the C++ client's tests check
the same file with the C++ encoders (tests/test_cpp_client.py)."""
from __future__ import annotations

import json
import sys

import msgpack
import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import make_vectors  # noqa: E402

sys.path.remove(str(REPO_ROOT / "scripts"))

STORED = json.loads(make_vectors.OUT.read_text())["vectors"]


@pytest.mark.parametrize("name", sorted(make_vectors.SPECS))
def test_vector_recomputed_from_its_params(name):
    what, fn, _ = make_vectors.SPECS[name]
    assert name in STORED, f"vector {name} missing from {make_vectors.OUT}; run scripts/make_vectors.py"
    got = fn(**STORED[name]["params"]).hex()
    assert got == STORED[name]["hex"], f"{name} ({what}): Python now produces different bytes"


def test_file_is_exactly_what_the_generator_writes():
    assert make_vectors.OUT.read_text() == make_vectors.render(make_vectors.build())


def test_vectors_agree_with_the_worked_example_of_protocol_md():
    """docs/protocol.md 13.1 prints the hello frame and 5 the claim word."""
    assert STORED["hello_frame"]["hex"] == (
        "0000002b84a26f70a568656c6c6fa776657273696f6e05a3706964cd1092"
        "ab6172656e615f6279746573ce00100000")
    assert int.from_bytes(bytes.fromhex(STORED["claim_word"]["hex"]), "little") == 0x8000000300001001
    req = bytes.fromhex(STORED["request_simple"]["hex"])
    assert len(req) == 3136 and req[:12] == bytes.fromhex("020000000200000002000000")
    assert req[12:64] == bytes(52)  # no options: flags .. reserved all 0
    # outputs[1] at request offset 1600 + 96: index 1, offset 0x280c0, capacity 64
    assert req[1696:1728] == bytes.fromhex("01000000" + "00" * 12 + "c080020000000000" + "4000000000000000")
    # 4.5's option fields, in the request_options vector
    opt = bytes.fromhex(STORED["request_options"]["hex"])
    params = bytes.fromhex(STORED["parameters_msgpack"]["hex"])
    assert opt[12:64] == (bytes.fromhex("03000000" "02000000") + len(params).to_bytes(4, "little")
                          + (1500).to_bytes(8, "little") + (0x28100).to_bytes(8, "little")
                          + (42).to_bytes(8, "little") + bytes(16))
    assert opt[64:] == req[64:]
    # a string correlation id: sequence_id 0, sequence_id_offset and _bytes set
    sid = bytes.fromhex(STORED["request_string_id"]["hex"])
    assert sid[12:64] == (bytes.fromhex("01000000") + bytes(32) + (0x28100).to_bytes(8, "little")
                          + (5).to_bytes(4, "little") + bytes(4))
    assert sid[64:] == req[64:]
    assert msgpack.unpackb(params) == {"flag": True, "n": 7, "tag": "cpp", "x": 1.5}
    # section 6a: a stream request is request_simple with flags STREAM (0x4)
    stream = bytes.fromhex(STORED["request_stream"]["hex"])
    assert stream[12:16] == (4).to_bytes(4, "little") and stream[16:64] == bytes(48)
    assert stream[64:] == req[64:]
    # ... and a published response: state RESPONSE (5), then the stream words
    resp = bytes.fromhex(STORED["slot_response"]["hex"])
    assert resp[:16] == bytes.fromhex("05000000" "01000000" "00000000" "01000000")
    assert resp[16 + 96:] == (2).to_bytes(4, "little") + bytes(12)


def test_frames_decode_to_their_params():
    for name in ("hello_frame", "metadata_frame", "error_reply_frame", "metadata_reply_frame"):
        raw = bytes.fromhex(STORED[name]["hex"])
        assert int.from_bytes(raw[:4], "big") == len(raw) - 4
        assert msgpack.unpackb(raw[4:], raw=False) == STORED[name]["params"]["message"]


def test_typed_control_messages_encode_the_vector_bytes():
    """The control messages declared in shmserve.protocol.control re-encode every frame
    vector byte for byte: the declaration, not a hand-built map, is what is checked."""
    from shmserve import protocol as P

    hello = bytes.fromhex(STORED["hello_frame"]["hex"])
    assert P.pack_frame(P.decode_request(STORED["hello_frame"]["params"]["message"])) == hello
    meta_req = STORED["metadata_frame"]["params"]["message"]
    assert P.pack_frame(P.decode_request(meta_req)).hex() == STORED["metadata_frame"]["hex"]
    reply = STORED["metadata_reply_frame"]["params"]["message"]
    typed = P.decode_reply(P.GetMetadata("simple"), reply)
    assert isinstance(typed, P.ModelMetadata)
    assert P.pack_frame(typed).hex() == STORED["metadata_reply_frame"]["hex"]
    error = STORED["error_reply_frame"]["params"]["message"]
    typed = P.decode_reply(P.GetMetadata("simple"), error)
    assert isinstance(typed, P.ErrorReply) and typed.code == P.Status.INVALID_ARG
    assert P.pack_frame(typed).hex() == STORED["error_reply_frame"]["hex"]


@pytest.mark.parametrize("wire, problem", [
    ({"op": "metadata", "model": 7}, "field 'model' must be str"),
    ({"op": "metadata", "version": 1}, "field 'model' is missing"),
    ({"op": "hello", "version": True}, "field 'version' must be int"),
    ({"op": "launch"}, "unknown control operation 'launch'"),
    ({"op": b"models"}, "field 'op' must be str, got bytes"),
    ({"op": "hello", "version": ""}, "field 'version' must be int or nil, got str"),
    ({"op": "metadata", "model": "m", "version": 1.0}, "field 'version' must be int or nil"),
    ({"op": "load", "model": "m", "files": [b"x"]}, "field 'files' must be dict or nil"),
    ({"op": "shm_register", "name": "r", "key": "/k", "offset": False, "byte_size": 8},
     "field 'offset' must be int, got bool"),
])
def test_control_messages_refuse_what_they_do_not_declare(wire, problem):
    from shmserve import protocol as P

    with pytest.raises(ValueError, match=problem):
        P.decode_request(wire)


def test_device_memory_vectors_are_the_layout_of_protocol_md():
    """Section 4.7's record and 4.6's kind-1 references, read back the way the server's
    worker reads them (gpu/ipc.py RECORD) and at the header's offsets."""
    from shmserve.gpu import ipc
    from shmserve.protocol import LAYOUT as L

    params = STORED["cuda_ipc_record"]["params"]
    rec = bytes.fromhex(STORED["cuda_ipc_record"]["hex"])
    assert len(rec) == L["cuda_ipc.size"] == 160
    assert ipc.RECORD.unpack(rec) == (bytes.fromhex(params["mem_handle"]),
                                      bytes.fromhex(params["event_handle"]), params["offset"],
                                      bytes.fromhex(params["device_uuid"]), ipc.EVENT, 0)
    fields = {"mem_handle": 0, "event_handle": 64, "offset": 128, "device_uuid": 136, "flags": 152}
    assert {f: L[f"cuda_ipc.{f}"] for f in fields} == fields
    assert rec[128:136] == params["offset"].to_bytes(8, "little") and rec[152:160] == bytes([1] + [0] * 7)
    out = bytes.fromhex(STORED["cuda_ipc_record_output"]["hex"])
    assert out[64:136] == bytes(72) and out[152:] == bytes(8)  # no event, flags 0, offset 0

    req = bytes.fromhex(STORED["request_device"]["hex"])
    p = STORED["request_device"]["params"]
    assert req[:12] == (7).to_bytes(4, "little") + (1).to_bytes(4, "little") + (1).to_bytes(4, "little")
    for at, (index, dtype, offset, nbytes, shape, kind, device) in (
            (L["request.inputs"], p["inputs"][0]), (L["request.outputs"], p["outputs"][0])):
        ref = req[at:at + L["tensor_ref.size"]]
        assert ref[12:16] == kind.to_bytes(2, "little") + device.to_bytes(2, "little") == bytes([1, 0, 1, 0])
        assert ref[16:32] == offset.to_bytes(8, "little") + nbytes.to_bytes(8, "little")
        assert ref[:12] == b"".join(v.to_bytes(4, "little") for v in (index, dtype, len(shape)))
    # one record after the other in the request's block, each 64-aligned (section 7a)
    in_record, out_record = p["inputs"][0][2], p["outputs"][0][2]
    assert in_record % 64 == 0 and out_record - in_record == -(-L["cuda_ipc.size"] // 64) * 64
