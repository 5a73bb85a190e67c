"""Triton's `model_warmup`: sample requests a worker runs through its model at load,
before the model is READY, so that the first callers do not pay for lazy
initialization. A sample that fails makes the model UNAVAILABLE with the reason.

    model_warmup [ { name: "w" batch_size: 4 count: 2
                     inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 16 ]
                                                     random_data: true } } } ]

As Triton: `dims` are one request's (the config's `dims`, not the model's reshape);
`batch_size` rows of them make the batch (a sample with batch_size 0 is skipped); it
runs `count` times (0: once); `zero_data` is zeros (empty strings for BYTES),
`random_data` random values, `input_data_file` names a file of the model's
`warmup/` directory holding one row's raw bytes in row-major order (BYTES: each
element a 4-byte little-endian length, then its bytes). Inputs marked `optional`
may be left out.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
from ..model_config import mc

from ..errors import ConfigError
from ..protocol import DTYPE_CODES, DTYPE_NAMES, DataType, decode_bytes, numpy_dtype

log = logging.getLogger("shmserve.worker")
WARMUP_DIR = "warmup"  # Triton's: <model>/warmup/<input_data_file>
_DATA_KINDS = ("zero_data", "random_data", "input_data_file")


class WarmupError(Exception):
    """A warmup sample could not be run; the model does not become READY."""


def _label(sample: mc.ModelWarmup, index: int) -> str:
    return f"model_warmup '{sample.name}'" if sample.name else f"model_warmup[{index}]"


def parse(cfg: mc.ModelConfig, model_dir: Path, where: str, inputs) -> tuple[dict, ...]:
    """The config's warmup samples, checked against its inputs (TensorSpecs), as plain
    dicts for the worker (ModelSpec.warmup). ConfigError names the sample and field."""
    by_name = {t.name: t for t in inputs}
    batched = cfg.max_batch_size > 0
    samples = []
    for index, sample in enumerate(cfg.model_warmup):
        label = f"{where}: {_label(sample, index)}"
        if sample.batch_size == 0:
            log.info("%s: batch_size 0, skipped (as Triton does)", label)
            continue
        if batched and sample.batch_size > cfg.max_batch_size:
            raise ConfigError(f"{label}: batch_size {sample.batch_size} exceeds max_batch_size "
                              f"{cfg.max_batch_size}")
        if not batched and sample.batch_size != 1:
            raise ConfigError(f"{label}: batch_size {sample.batch_size}: a model with "
                              "max_batch_size 0 takes batch_size 1")
        given = {}
        for name, data in sorted(sample.inputs.items()):
            given[name] = _input(label, model_dir, by_name, name, data)
        missing = [t.name for t in inputs if t.name not in given and not t.optional]
        if missing:
            raise ConfigError(f"{label}: gives no data for input{'s' * (len(missing) > 1)} "
                              + ", ".join(f"'{n}'" for n in missing))
        samples.append({"name": sample.name or f"[{index}]", "batch_size": sample.batch_size,
                        "count": max(sample.count, 1), "inputs": given})
    return tuple(samples)


def _input(label: str, model_dir: Path, by_name: dict, name: str, data) -> dict:
    tensor = by_name.get(name)
    if tensor is None:
        raise ConfigError(f"{label}: input '{name}' is not an input of the model "
                          f"(inputs: {', '.join(by_name)})")
    type_name = mc.DataType.Name(data.data_type).removeprefix("TYPE_").replace("STRING", "BYTES")
    if DTYPE_CODES.get(type_name) != tensor.dtype:
        raise ConfigError(f"{label}: input '{name}' has data_type {mc.DataType.Name(data.data_type)}"
                          f", the model's input is TYPE_{DTYPE_NAMES[tensor.dtype]}"
                          .replace("TYPE_BYTES", "TYPE_STRING"))
    dims = tuple(int(d) for d in data.dims)
    fits = len(dims) == len(tensor.dims) and all(
        d > 0 and (want == -1 or d == want) for d, want in zip(dims, tensor.dims))
    if not fits:
        raise ConfigError(f"{label}: input '{name}' dims {list(dims)} do not fit the input's "
                          f"dims {list(tensor.dims)} (each a size > 0, without the batch "
                          "dimension)")
    kind = data.WhichOneof("input_data_type")
    if kind is None:
        raise ConfigError(f"{label}: input '{name}' gives no data (set one of "
                          f"{', '.join(_DATA_KINDS)})")
    path = ""
    if kind == "input_data_file":
        folder = (model_dir / WARMUP_DIR).resolve()
        file = (folder / data.input_data_file).resolve()
        if not file.is_relative_to(folder):
            raise ConfigError(f"{label}: input '{name}' input_data_file "
                              f"{data.input_data_file!r} is outside {folder}")
        if not file.is_file():
            raise ConfigError(f"{label}: input '{name}' input_data_file {file} does not exist "
                              f"(warmup files live in {folder})")
        path = str(file)
    return {"dtype": tensor.dtype, "dims": list(dims), "data": kind, "file": path}


def _row(name: str, d: dict, rng: np.random.Generator) -> np.ndarray:
    """One row of an input's warmup data."""
    dims, count = tuple(d["dims"]), math.prod(d["dims"])
    if d["dtype"] == DataType.BYTES:
        if d["data"] == "input_data_file":
            return decode_bytes(Path(d["file"]).read_bytes(), dims)
        arr = np.empty(count, dtype=object)
        for i in range(count):
            arr[i] = b"" if d["data"] == "zero_data" else rng.bytes(8)
        return arr.reshape(dims)
    dt = numpy_dtype(d["dtype"])
    if d["data"] == "zero_data":
        return np.zeros(dims, dt)
    if d["data"] == "random_data":
        if dt.kind == "b":
            return rng.integers(0, 2, dims).astype(dt)
        if dt.kind in "iu":
            return rng.integers(0, 100, dims).astype(dt)
        return rng.random(dims).astype(dt)
    raw = Path(d["file"]).read_bytes()
    need = count * dt.itemsize
    if len(raw) < need:
        raise WarmupError(f"input '{name}': {d['file']} holds {len(raw)} bytes, one row of "
                          f"{list(dims)} {DTYPE_NAMES[d['dtype']]} needs {need}")
    return np.frombuffer(raw, dt, count).reshape(dims)


def run(spec, execute) -> None:
    """Runs each of spec.warmup's samples `count` times through execute(inputs, rows),
    the worker's path for a batch (inputs as callers send them). WarmupError names
    the sample that failed and why."""
    rng = np.random.default_rng()
    batched = spec.max_batch_size > 0
    for sample in spec.warmup:
        label = f"model '{spec.name}' version {spec.version}: model_warmup '{sample['name']}'"
        rows = sample["batch_size"]
        try:
            inputs = {}
            for name, d in sample["inputs"].items():
                row = _row(name, d, rng)
                inputs[name] = np.repeat(row[None], rows, axis=0) if batched else row
        except (OSError, ValueError, WarmupError) as e:
            raise WarmupError(f"{label}: {e}") from None
        for k in range(sample["count"]):
            try:
                execute(dict(inputs), rows)
            except Exception as e:  # whatever the model raised: the load fails with it
                raise WarmupError(f"{label} failed (execution {k + 1} of {sample['count']}): "
                                  f"{type(e).__name__}: {e}") from None
        log.info("%s: ran %d time%s, batch size %d", label, sample["count"],
                 "s" * (sample["count"] != 1), rows)
