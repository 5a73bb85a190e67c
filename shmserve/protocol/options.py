"""Request options (docs/protocol.md, section 4.5): priority, queue timeout, sequence
id and flags, and request parameters, Triton's map of name -> bool / int / float /
str, carried as one msgpack map in the caller's arena.

encode_parameters() is the clients' (it refuses what a server would); decode_parameters()
is the server's and treats its input as hostile bytes: every failure is a ValueError
naming what is wrong, never another exception."""
from __future__ import annotations

import collections.abc

import msgpack

from .layout import LAYOUT

__all__ = ["MAX_PARAMETER_BYTES", "MAX_SEQUENCE_ID_BYTES", "SEQUENCE_START", "SEQUENCE_END", "STREAM",
           "encode_parameters", "decode_parameters", "decode_sequence_id", "options"]

MAX_PARAMETER_BYTES = LAYOUT["MAX_PARAMETER_BYTES"]
MAX_SEQUENCE_ID_BYTES = LAYOUT["MAX_SEQUENCE_ID_BYTES"]
SEQUENCE_START = LAYOUT["REQUEST_SEQUENCE_START"]
SEQUENCE_END = LAYOUT["REQUEST_SEQUENCE_END"]
STREAM = LAYOUT["REQUEST_STREAM"]  # several responses in the slot (Client.infer_stream)
U32_MAX, U64_MAX = (1 << 32) - 1, (1 << 64) - 1
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def _check_value(key, value, where: str):
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: parameter names must be non-empty strings, got {key!r}")
    if isinstance(value, bool) or isinstance(value, (str, float)):
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise ValueError(f"{where}: parameter '{key}' is outside int64")
        return
    raise ValueError(f"{where}: parameter '{key}' is a {type(value).__name__}; "
                     "parameters are bool, int, float or str")


def encode_parameters(parameters) -> bytes | None:
    """The msgpack bytes of a parameters mapping (None or empty: None). Raises
    ValueError (what a server would refuse) or TypeError (not a mapping)."""
    if not parameters:
        return None
    if not isinstance(parameters, collections.abc.Mapping):
        raise TypeError(f"parameters must be a mapping of str to bool/int/float/str, "
                        f"got {type(parameters).__name__}")
    for key, value in parameters.items():
        _check_value(key, value, "request parameters")
    data = msgpack.packb(dict(parameters), use_bin_type=True)
    if len(data) > MAX_PARAMETER_BYTES:
        raise ValueError(f"request parameters take {len(data)} bytes packed "
                         f"(limit {MAX_PARAMETER_BYTES})")
    return data


def decode_parameters(data) -> dict:
    """The parameters in `data` (bytes a client wrote): a dict of str to bool / int /
    float / str. Raises ValueError saying what is wrong with them."""
    if len(data) > MAX_PARAMETER_BYTES:
        raise ValueError(f"request parameters hold {len(data)} bytes (limit {MAX_PARAMETER_BYTES})")
    try:
        # Bounded by the size check; strict keys; no ext types, no bin in place of str.
        got = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises a family of errors on hostile input
        raise ValueError(f"request parameters are not valid msgpack ({type(e).__name__}: {e})") \
            from None
    if not isinstance(got, dict):
        raise ValueError(f"request parameters must be a msgpack map, got {type(got).__name__}")
    for key, value in got.items():
        _check_value(key, value, "request parameters")
    return got


def options(priority=0, timeout_us=0, parameters=None, sequence_id=0, sequence_start=False,
            sequence_end=False):
    """The options tuple both client paths take (flags, priority, timeout_us, packed
    parameters or None, sequence_id), or None when every option is left at its
    default. A string sequence_id (Triton's string correlation id) gives a sixth
    element, its UTF-8 bytes, with sequence_id 0: only the Python path sends those.
    Raises ValueError / TypeError for a value the protocol cannot carry."""
    packed = encode_parameters(parameters)
    flags = (SEQUENCE_START if sequence_start else 0) | (SEQUENCE_END if sequence_end else 0)
    if not (priority or timeout_us or packed or sequence_id or flags):
        return None
    string_id = None
    if isinstance(sequence_id, str):
        string_id = sequence_id.encode()
        if len(string_id) > MAX_SEQUENCE_ID_BYTES:
            raise ValueError(f"sequence_id takes {len(string_id)} bytes as UTF-8 "
                             f"(limit {MAX_SEQUENCE_ID_BYTES})")
        sequence_id = 0
    for name, value, top in (("priority", priority, U32_MAX), ("timeout_us", timeout_us, U64_MAX),
                             ("sequence_id", sequence_id, U64_MAX)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise ValueError(f"{name} must be an integer in 0..{top}" +
                             (" or a string" if name == "sequence_id" else "") + f", got {value!r}")
    if string_id:
        return (flags, priority, timeout_us, packed, 0, string_id)
    return (flags, priority, timeout_us, packed, sequence_id)


def decode_sequence_id(data) -> str:
    """A string correlation id a client wrote (hostile bytes): ValueError if not UTF-8."""
    try:
        return bytes(data).decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"the string correlation id is not UTF-8 ({e})") from None
