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
        "0000002b84a26f70a568656c6c6fa776657273696f6e02a3706964cd1092"
        "ab6172656e615f6279746573ce00100000")
    assert int.from_bytes(bytes.fromhex(STORED["claim_word"]["hex"]), "little") == 0x8000000300001001
    req = bytes.fromhex(STORED["request_simple"]["hex"])
    assert len(req) == 3104 and req[:12] == bytes.fromhex("020000000200000002000000")
    # outputs[1] at request offset 1568 + 96: index 1, offset 0x280c0, capacity 64
    assert req[1664:1696] == bytes.fromhex("01000000" + "00" * 12 + "c080020000000000" + "4000000000000000")


def test_frames_decode_to_their_params():
    for name in ("hello_frame", "metadata_frame", "error_reply_frame", "metadata_reply_frame"):
        raw = bytes.fromhex(STORED[name]["hex"])
        assert int.from_bytes(raw[:4], "big") == len(raw) - 4
        assert msgpack.unpackb(raw[4:], raw=False) == STORED[name]["params"]["message"]
