"""Data types: Triton's DataType numbers, their numpy equivalents, and the BYTES
tensor encoding (a 4-byte little-endian length, then the bytes, per element)."""
from __future__ import annotations

import math
import struct

import numpy as np

from .layout import DataType

# Triton's DataType numbers (the header's list); names are Triton's without TYPE_.
DTYPE_CODES = {t.name: int(t) for t in DataType if t != DataType.INVALID}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
try:  # BF16 exists in numpy only through ml_dtypes
    import ml_dtypes

    _NUMPY["BF16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    pass


def numpy_dtype(code: int) -> np.dtype:
    name = DTYPE_NAMES.get(code)
    if name not in _NUMPY:
        raise TypeError(f"data type {name or code} has no numpy equivalent here"
                        + (" (install ml_dtypes for BF16)" if name == "BF16" else ""))
    return _NUMPY[name]


def dtype_code(dtype: np.dtype) -> int:
    """Protocol code of a numpy dtype; str/bytes/object arrays are BYTES."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return DTYPE_CODES["BYTES"]
    for name, nd in _NUMPY.items():
        if nd == dtype and name != "BYTES":
            return DTYPE_CODES[name]
    raise TypeError(f"numpy dtype {dtype} has no shmserve data type")


# BYTES tensors: each element is a 4-byte little-endian length then the bytes.
def encode_bytes(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        b = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_bytes(buf, shape) -> np.ndarray:
    """Parses a BYTES buffer; raises ValueError on any length that runs past it."""
    mv = memoryview(buf)
    count = math.prod(int(d) for d in shape)
    if count < 0 or 4 * count > len(mv):  # every element needs its 4-byte length
        raise ValueError(f"BYTES tensor of shape {list(shape)} needs at least {4 * count} "
                         f"bytes, has {len(mv)}")
    out = np.empty(count, dtype=object)
    pos, end = 0, len(mv)
    for i in range(count):
        if pos + 4 > end:
            raise ValueError(f"BYTES tensor truncated at element {i} of {count}")
        (n,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        if n > end - pos:
            raise ValueError(f"BYTES element {i} claims {n} bytes, {end - pos} left")
        out[i] = bytes(mv[pos:pos + n])
        pos += n
    if pos != end:
        raise ValueError(f"BYTES tensor has {end - pos} bytes after its {count} elements")
    return out.reshape(shape)
