"""Ragged batching, as Triton's: inputs with `allow_ragged_batch` batch together
whatever their dims (the batcher's shape key leaves their dims out: shms_shape_key);
the worker hands the model such an input as one 1-dimensional concatenation of the
requests' elements, as Triton's onnxruntime, pytorch and tensorrt backends do, and
adds the `batch_input` tensors that say where each request lies in it:

  BATCH_ELEMENT_COUNT                        [n_requests]: each request's element count
  BATCH_ACCUMULATED_ELEMENT_COUNT            [n_requests]: their running sum
  BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO  [n_requests + 1]: 0, then the running sum
  BATCH_MAX_ELEMENT_COUNT_AS_SHAPE           [max count]: its shape is the information
  BATCH_ITEM_SHAPE                           [rows, ndim]: each row's shape (batch dim out)
  BATCH_ITEM_SHAPE_FLATTEN                   [rows * ndim]: the same, flat

A `batch_output` BATCH_SCATTER_WITH_INPUT_SHAPE output comes back concatenated the
same way: each request gets as many elements as its source input has, in that
input's shape. Triton's python models written with the per-request API see each
request's own tensors (nothing is concatenated), so they take ragged inputs but no
batch_input or batch_output.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..model_config import mc

ELEMENT_COUNT, ACCUMULATED, ACCUMULATED_WITH_ZERO, MAX_AS_SHAPE, ITEM_SHAPE, ITEM_SHAPE_FLAT = (
    "BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN")
SCATTER_WITH_INPUT_SHAPE = "BATCH_SCATTER_WITH_INPUT_SHAPE"
_DTYPES = {mc.TYPE_INT32: np.int32, mc.TYPE_FP32: np.float32}


def parse(cfg: mc.ModelConfig, where: str) -> tuple[tuple, tuple]:
    """(batch_inputs, batch_outputs) of a config, checked: ((kind, target, numpy dtype
    name, source), ...), ((kind, targets, source), ...)."""
    inputs = {t.name: t for t in cfg.input}
    outputs = {t.name for t in cfg.output}
    ragged = [t.name for t in cfg.input if t.allow_ragged_batch]
    if (ragged or cfg.batch_input or cfg.batch_output) and cfg.max_batch_size <= 0:
        what = (f"input '{ragged[0]}' allow_ragged_batch" if ragged
                else "batch_input" if cfg.batch_input else "batch_output")
        raise ConfigError(f"{where}: {what} needs max_batch_size > 0 (it is about how "
                          "requests batch together)")
    if (cfg.batch_input or cfg.batch_output) and cfg.HasField("sequence_batching"):
        raise ConfigError(f"{where}: batch_input and batch_output are not implemented by "
                          "shmserve with sequence_batching")
    batch_inputs = []
    for b in cfg.batch_input:
        kind = mc.BatchInput.Kind.Name(b.kind)
        what = f"{where}: batch_input {kind}"
        if len(b.source_input) != 1 or b.source_input[0] not in inputs:
            raise ConfigError(f"{what}: source_input must name one input of the model "
                              f"(its inputs: {', '.join(inputs)})")
        if b.data_type not in _DTYPES:
            raise ConfigError(f"{what}: data_type must be TYPE_INT32 or TYPE_FP32, not "
                              f"{mc.DataType.Name(b.data_type)}")
        if not b.target_name:
            raise ConfigError(f"{what}: target_name names the model input it makes")
        for target in b.target_name:
            if target in inputs or any(target == t for _, t, _, _ in batch_inputs):
                raise ConfigError(f"{what}: target_name '{target}' is already an input")
            batch_inputs.append((kind, target, np.dtype(_DTYPES[b.data_type]).name,
                                 b.source_input[0]))
    batch_outputs = []
    for b in cfg.batch_output:
        kind = mc.BatchOutput.Kind.Name(b.kind)
        what = f"{where}: batch_output {kind}"
        if len(b.source_input) != 1 or b.source_input[0] not in inputs:
            raise ConfigError(f"{what}: source_input must name one input of the model")
        unknown = [t for t in b.target_name if t not in outputs]
        if not b.target_name or unknown:
            raise ConfigError(f"{what}: target_name must name outputs of the model"
                              + (f" ('{unknown[0]}' is not one)" if unknown else ""))
        batch_outputs.append((kind, tuple(b.target_name), b.source_input[0]))
    return tuple(batch_inputs), tuple(batch_outputs)


def batch_input_arrays(batch_inputs, shapes: list[dict]) -> dict:
    """The batch_input tensors of a batch; shapes: per request, input name -> its shape
    (batch dimension first)."""
    out = {}
    for kind, target, dtype, source in batch_inputs:
        per = [s[source] for s in shapes]
        counts = np.array([int(np.prod(s)) for s in per], np.int64)
        if kind == ELEMENT_COUNT:
            arr = counts
        elif kind == ACCUMULATED:
            arr = np.cumsum(counts)
        elif kind == ACCUMULATED_WITH_ZERO:
            arr = np.concatenate([[0], np.cumsum(counts)])
        elif kind == MAX_AS_SHAPE:
            arr = np.zeros(int(counts.max()) if len(counts) else 0)  # the shape is the message
        else:  # ITEM_SHAPE(_FLATTEN): one row per batch row, the dims after the batch one
            arr = np.array([s[1:] for s in per for _ in range(s[0])], np.int64)
            if kind == ITEM_SHAPE_FLAT:
                arr = arr.reshape(-1)
        out[target] = arr.astype(dtype)
    return out


def split_outputs(outputs: dict, batch_outputs, shapes: list[dict], rows: list[int],
                  batched: bool) -> list[dict]:
    """Each request's part of a batch's outputs: a batch_output target by its source
    input's element count and shape, any other output by rows."""
    scattered = {t: source for _, targets, source in batch_outputs for t in targets}
    parts = [{} for _ in rows]
    for name, arr in outputs.items():
        source = scattered.get(name)
        if source is None:
            at = 0
            for part, n in zip(parts, rows):
                part[name] = arr[at:at + n] if batched else arr
                at += n
            continue
        flat, at = arr.reshape(-1), 0
        for part, s in zip(parts, shapes):
            n = int(np.prod(s[source]))
            if at + n > flat.size:
                raise ValueError(f"output '{name}' has {flat.size} elements, fewer than its "
                                 f"source input '{source}' has in the batch")
            part[name] = flat[at:at + n].reshape(s[source])
            at += n
    return parts
