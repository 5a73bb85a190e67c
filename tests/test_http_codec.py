"""The HTTP front's body decoder (shmserve/front/codec.py) without a server: any body,
however hostile, is decoded or refused with BadRequest (a 400), nothing else; valid
bodies decode to the arrays they describe."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve.front import codec

pytestmark = pytest.mark.timeout(120)


def decode(body: bytes, header_len: int | None) -> dict:
    """What the front does with a body: header, inputs, binary section."""
    head = body if header_len is None else body[:header_len]
    if header_len is not None and len(head) < header_len:
        raise codec.BadRequest("short")
    header = codec.parse_header(head)
    inputs = codec.plan_inputs(header, np.empty)
    filler = codec.BinaryFiller(inputs)
    if header_len is not None:
        filler.feed(body[header_len:])
    filler.close()
    codec.wanted_outputs(header)
    codec.class_counts((o["name"], o.get("parameters") or {}) for o in header.get("outputs") or [])
    return {t.name: t.finish() for t in inputs}


def test_binary_and_json_inputs_decode():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array([b"x", b"\xff\x00yz"], dtype=object)
    from shmserve.protocol import encode_bytes

    raw_s = encode_bytes(s)
    header = json.dumps({"inputs": [
        {"name": "A", "shape": [2, 3], "datatype": "FP32",
         "parameters": {"binary_data_size": a.nbytes}},
        {"name": "B", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]},
        {"name": "S", "shape": [2], "datatype": "BYTES",
         "parameters": {"binary_data_size": len(raw_s)}},
        {"name": "T", "shape": [1], "datatype": "BYTES", "data": ["hé"]},
        {"name": "Z", "shape": [2], "datatype": "BOOL", "data": [True, False]}]}).encode()
    body = header + a.tobytes() + raw_s
    # Fed in pieces of every size, as the socket may hand them over.
    for piece in (1, 3, 7, len(body)):
        h = codec.parse_header(header)
        inputs = codec.plan_inputs(h, np.empty)
        filler = codec.BinaryFiller(inputs)
        rest = body[len(header):]
        for i in range(0, len(rest), piece):
            filler.feed(rest[i:i + piece])
        filler.close()
        got = {t.name: t.finish() for t in inputs}
        np.testing.assert_array_equal(got["A"], a)
        np.testing.assert_array_equal(got["B"], [[1, 2], [3, 4]])
        assert got["B"].dtype == np.int64
        assert list(got["S"]) == [b"x", b"\xff\x00yz"]
        assert list(got["T"]) == ["hé".encode()]
        np.testing.assert_array_equal(got["Z"], [True, False])


@pytest.mark.parametrize("data, words", [
    ([1.5, 2], "not INT32"),
    (["a", 1], "not INT32"),
    ([[1, 2], [3]], "needs 2 elements"),
    ([1, 2, 3], "needs 2 elements"),
])
def test_json_data_that_does_not_fit_is_refused(data, words):
    header = json.dumps({"inputs": [{"name": "A", "shape": [2], "datatype": "INT32",
                                     "data": data}]}).encode()
    with pytest.raises(codec.BadRequest, match=words):
        decode(header, None)


tensors = st.fixed_dictionaries({
    "name": st.one_of(st.text(max_size=4), st.integers()),
    "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), st.text(max_size=2)),
    "datatype": st.sampled_from(["FP32", "INT8", "BYTES", "BOOL", "FP16", "UINT64", "XX", 3]),
}, optional={
    "data": st.recursive(st.one_of(st.integers(-300, 300), st.floats(allow_nan=False),
                                   st.booleans(), st.text(max_size=3), st.none()),
                         lambda c: st.lists(c, max_size=4), max_leaves=10),
    "parameters": st.one_of(st.none(), st.integers(),
                            st.fixed_dictionaries({"binary_data_size": st.integers(-1, 40)}),
                            st.dictionaries(st.text(max_size=22), st.integers(), max_size=2)),
})


@settings(max_examples=400, deadline=None)
@given(inputs=st.lists(tensors, max_size=3), tail=st.binary(max_size=64),
       outputs=st.one_of(st.none(), st.integers(),
                         st.lists(st.fixed_dictionaries({"name": st.text(max_size=3)}, optional={
                             "parameters": st.dictionaries(st.sampled_from(
                                 ["binary_data", "classification", "x"]), st.booleans())}),
                             max_size=2)),
       use_header_len=st.booleans(), cut=st.integers(0, 80))
def test_any_structured_body_is_decoded_or_refused(inputs, tail, outputs, use_header_len, cut):
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    body = header + tail
    header_len = len(header) + cut - 40 if use_header_len else None
    try:
        decode(body, None if header_len is None else max(header_len, 0))
    except codec.BadRequest:
        pass


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200), header_len=st.one_of(st.none(), st.integers(0, 220)))
def test_any_bytes_are_decoded_or_refused(body, header_len):
    try:
        decode(body, header_len)
    except codec.BadRequest:
        pass


def test_declared_sizes_must_fit_the_body():
    """Nothing is allocated for a binary_data_size the body cannot hold."""
    header = {"inputs": [{"name": "S", "shape": [1], "datatype": "BYTES",
                          "parameters": {"binary_data_size": 1 << 40}}]}
    with pytest.raises(codec.BadRequest, match="the body holds 5"):
        codec.plan_inputs(header, np.empty, binary_bytes=5)
    with pytest.raises(codec.BadRequest, match="more than"):
        codec.plan_inputs(header, np.empty, max_binary=1 << 20)


def test_classification_top_k():
    """classification.classify: Triton's "value:index[:label]" strings, per batch item,
    largest first, equal values by index, k cut to what a row holds."""
    from shmserve.front.classification import classify

    x = np.array([[1, 3, 3, 0], [7, 0, 0, 8]], dtype=np.uint8)
    out = classify(x, "UINT8", 3, True, ["a", "b"], "y")
    assert out.shape == (2, 3)
    assert out.tolist() == [[b"3:1:b", b"3:2", b"1:0:a"], [b"8:3", b"7:0:a", b"0:1:b"]]
    half = np.array([0.5, -1.0, 2.0], dtype=np.float16)
    assert classify(half, "FP16", 9, False, [], "y").tolist() == [
        b"2.000000:2", b"0.500000:0", b"-1.000000:1"]
    with pytest.raises(codec.BadRequest, match="output 'y'.*unsupported type 'BOOL'"):
        classify(np.array([True]), "BOOL", 1, False, [], "y")
    for bad in (0, -2, True, 1.5, "3"):
        with pytest.raises(codec.BadRequest, match="'classification' must be a positive"):
            codec.class_counts([("y", {"classification": bad})])
