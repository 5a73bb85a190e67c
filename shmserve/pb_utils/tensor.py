"""pb_utils.Tensor and the data type helpers of Triton's python model API.

A Tensor is a name and a numpy array, nothing more: an input tensor's array is a view
of the caller's shared memory (no copy), an output tensor's array is copied once into
the caller's arena after execute() returns. BYTES tensors are numpy object arrays.
The type is C (csrc/pb_types.c) with its rarely called methods written here.
"""
from __future__ import annotations

import struct

import numpy as np

from .. import _core
from ..protocol import DTYPE_CODES, decode_bytes, dtype_code, encode_bytes, numpy_dtype
from .errors import TritonModelException

_CPU = 1  # DLPack's kDLCPU


class _TensorMethods:
    """pb_utils.Tensor(name, numpy_array)'s methods besides name() and as_numpy(): the
    class Tensor is made from (below). The type, its fields (_name, _array), its
    constructor's common case and those two methods are C (csrc/pb_types.c): a model
    makes a Tensor per output of every request."""

    __slots__ = ()

    @staticmethod
    def _checked(name, numpy_array) -> np.ndarray:
        """The constructor's rare case (not an ndarray, a name not a str, a dtype that
        may be refused): the array to hold, or why the arguments are refused."""
        numpy_array = np.asarray(numpy_array)
        if not isinstance(name, str):
            raise TritonModelException(f"pb_utils.Tensor: name must be a str, got "
                                       f"{type(name).__name__}")
        if numpy_array.dtype.kind in "UV":  # as Triton: strings travel as object (bytes) arrays
            raise TritonModelException(
                f"pb_utils.Tensor '{name}': numpy dtype {numpy_array.dtype} is not supported by "
                "the python backend; use np.object_ (bytes or str elements) for BYTES tensors")
        return numpy_array

    def triton_dtype(self) -> int:
        """Triton's TRITONSERVER_DataType number (TYPE_FP32 = 11, BYTES = 13, ...)."""
        return dtype_code(self._array.dtype)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True  # shmserve's python backend holds tensors in (shared) host memory

    # -- DLPack: numpy's own, zero-copy ------------------------------------------------
    def to_dlpack(self):
        """A DLPack capsule of the array (e.g. for torch.utils.dlpack.from_dlpack)."""
        try:
            return self._array.__dlpack__()
        except (BufferError, TypeError) as e:
            raise TritonModelException(f"pb_utils.Tensor '{self._name}'.to_dlpack(): {e}") from None

    def __dlpack__(self, *, stream=None, **kwargs):
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack) -> "Tensor":
        """A Tensor viewing the memory of a DLPack capsule or of an object with
        __dlpack__ (a torch tensor, a cupy array on the CPU...). Host memory only."""
        source = _Capsule(dlpack) if type(dlpack).__name__ == "PyCapsule" else dlpack
        try:
            array = np.from_dlpack(source)
        except (BufferError, TypeError, RuntimeError, ValueError) as e:
            raise TritonModelException(
                f"pb_utils.Tensor.from_dlpack('{name}'): {e} (shmserve's python backend holds "
                "host-memory tensors only)") from None
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"pb_utils.Tensor({self._name!r}, {self._array.dtype}{list(self._array.shape)})"


Tensor = _core.pb_tensor_type(_TensorMethods)


class _Capsule:
    """A bare DLPack capsule, as Triton's from_dlpack accepts one; numpy wants an
    object with __dlpack__. A capsule of device memory is refused by numpy."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (_CPU, 0)


# -- data type helpers (Triton's names and numbers) -------------------------------------
def triton_to_numpy_type(data_type: int):
    """numpy type of a TRITONSERVER_DataType number (None if unknown)."""
    try:
        dt = numpy_dtype(int(data_type))
    except TypeError:
        return None
    return np.object_ if dt == np.dtype(object) else dt.type


def numpy_to_triton_type(data_type) -> int | None:
    """TRITONSERVER_DataType number of a numpy type (None if it has none)."""
    try:
        return dtype_code(np.dtype(data_type))
    except TypeError:
        return None


def triton_string_to_numpy(triton_type_string: str):
    """numpy type of a config data_type name such as "TYPE_FP32" (KeyError if unknown)."""
    name = triton_type_string.removeprefix("TYPE_").replace("STRING", "BYTES")
    if name not in DTYPE_CODES:
        raise KeyError(triton_type_string)
    return triton_to_numpy_type(DTYPE_CODES[name])


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | None:
    """A BYTES tensor as Triton lays it out: per element a 4-byte little-endian length,
    then the bytes (str elements UTF-8). None for arrays that are not object/bytes."""
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return encode_bytes(np.ascontiguousarray(input_tensor))


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    """The 1-D object array of the elements of a serialized BYTES tensor."""
    view = memoryview(encoded_tensor).cast("B")
    count, pos = 0, 0
    while pos + 4 <= len(view):  # count the elements, then let the protocol's parser check
        pos += 4 + struct.unpack_from("<I", view, pos)[0]
        count += 1
    return decode_bytes(view, (count,))

