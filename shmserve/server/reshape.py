"""Triton's `reshape` of a tensor: `dims` is the shape callers send and receive (the
batcher validates requests against it), `reshape { shape }` the shape the model
takes or produces. The batch dimension, when the model batches, stays first and is
never reshaped.

Rules, as Triton's: the two shapes hold the same elements. Without a variable-size
dimension (-1) their element counts are equal (`reshape: { shape: [ ] }` is the one
element of `dims: [ 1 ]`); with them, the runs of fixed dimensions between the -1s
hold the same counts on both sides (from [2, 4, -1, 6] to [8, -1, 1, 6]: 2*4 = 8 and
6 = 1*6), and the k-th -1 of one side takes the size of the k-th -1 of the other.
"""
from __future__ import annotations

import math

import numpy as np


def _runs(shape) -> list[int]:
    """Element counts of the runs of fixed dims, split at each -1."""
    runs, count = [], 1
    for d in shape:
        if d == -1:
            runs.append(count)
            count = 1
        else:
            count *= d
    return runs + [count]


def check(dims, shape) -> str | None:
    """Why `shape` cannot be the reshape of `dims` (both without the batch dimension),
    or None when it can."""
    if any(d < -1 or d == 0 for d in shape):
        return f"reshape {list(shape)}: each dimension must be -1 or > 0"
    if _runs(dims) != _runs(shape):
        return (f"reshape {list(shape)} does not hold the elements of dims {list(dims)} "
                "(their element counts, or those between variable-size dimensions, differ)")
    return None


def _moved(arr: np.ndarray, src, dst, batched: bool) -> np.ndarray:
    """arr (shaped like src, batch first when batched) reshaped to dst, the sizes of
    src's variable dims carried into dst's in order."""
    lead = arr.shape[:1] if batched else ()
    body = arr.shape[len(lead):]
    if len(body) != len(src):
        raise ValueError(f"has shape {list(arr.shape)}, expected "
                         f"{'[batch] + ' if batched else ''}{list(src)}")
    sizes = iter([n for n, d in zip(body, src) if d == -1])
    target = tuple(next(sizes) if d == -1 else d for d in dst)
    if math.prod(target) != math.prod(body):
        raise ValueError(f"has shape {list(arr.shape)}, which does not reshape to "
                         f"{list(lead + target)}")
    return arr.reshape(lead + target)


def to_model(tensor, arr: np.ndarray, batched: bool) -> np.ndarray:
    """An input as callers sent it (config dims) in the shape the model takes."""
    return _moved(arr, tensor.dims, tensor.reshape, batched)


def to_caller(tensor, arr: np.ndarray, batched: bool) -> np.ndarray:
    """An output as the model produced it (reshape shape) in the config's dims."""
    return _moved(arr, tensor.reshape, tensor.dims, batched)
