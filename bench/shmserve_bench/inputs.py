"""Request data: random, zeros, .npy files or a perf_analyzer-style JSON file.

`meta` is a model's KServe v2 metadata as every target returns it:
{"inputs": [{"name", "datatype", "shape"}], "max_batch_size": int}; for a batched
model the first dim of each shape is the batch (-1).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shmserve import protocol as P


class InputError(ValueError):
    pass


def parse_shapes(specs) -> dict[str, list[int]]:
    """perf_analyzer's --shape NAME:d1,d2 (NAME=d1,d2 accepted too), without the batch dim."""
    out = {}
    for spec in specs or ():
        sep = ":" if ":" in spec else "="
        name, _, dims = spec.rpartition(sep)
        if not name or not dims:
            raise InputError(f"--shape '{spec}': expected NAME:d1,d2,...")
        try:
            out[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise InputError(f"--shape '{spec}': dims must be integers") from None
    return out


def _dtype(datatype: str) -> np.dtype:
    if datatype == "BYTES":
        return np.dtype(object)
    return P.numpy_dtype(P.DTYPE_CODES[datatype])


def _dims(meta: dict, spec: dict, shapes: dict, batch: int) -> list[int]:
    batched = meta.get("max_batch_size", 0) > 0
    dims = list(spec["shape"][1:] if batched else spec["shape"])
    if spec["name"] in shapes:
        given = shapes[spec["name"]]
        if len(given) != len(dims) or any(d >= 0 and d != g for d, g in zip(dims, given)):
            raise InputError(f"--shape {spec['name']}:{','.join(map(str, given))} does not fit "
                             f"the model's dims {dims}")
        dims = given
    if any(d < 0 for d in dims):
        raise InputError(f"input '{spec['name']}' has variable dims {dims}: give "
                         f"--shape {spec['name']}:d1,... or data with a shape")
    return ([batch] if batched else []) + dims


def generate(meta: dict, kind: str = "random", shapes=None, batch: int = 1, seed: int = 0) -> dict:
    """One request's inputs: 'random' (normal for floats, 0..99 for ints) or 'zero'."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in meta["inputs"]:
        shape = _dims(meta, spec, shapes or {}, batch)
        dt = _dtype(spec["datatype"])
        if dt == object:
            n = int(np.prod(shape))
            out[spec["name"]] = np.array([f"{i}".encode() for i in range(n)], object).reshape(shape)
        elif kind in ("zero", "zeros"):
            out[spec["name"]] = np.zeros(shape, dt)
        elif dt.kind == "f" or dt.name == "bfloat16":
            out[spec["name"]] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            out[spec["name"]] = rng.integers(0, 2, shape).astype(dt)
        else:
            out[spec["name"]] = rng.integers(0, 100, shape).astype(dt)
    return out


def _fit(meta: dict, spec: dict, arr: np.ndarray, batch: int) -> np.ndarray:
    """Adds the batch dim to data given without it."""
    arr = np.asarray(arr, dtype=_dtype(spec["datatype"]))
    batched = meta.get("max_batch_size", 0) > 0
    if batched and arr.ndim == len(spec["shape"]) - 1:
        arr = np.repeat(arr[None], batch, axis=0)
    return arr


def from_json(meta: dict, path: Path, shapes=None, batch: int = 1) -> list[dict]:
    """perf_analyzer's JSON data file: {"data": [{NAME: [values...] |
    {"content": [...], "shape": [...]}}, ...]}; one request per entry, cycled."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--input-data {path}: {e}") from None
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not entries:
        raise InputError(f"--input-data {path}: expected {{\"data\": [{{NAME: values}}, ...]}}")
    specs = {s["name"]: s for s in meta["inputs"]}
    sets = []
    for i, entry in enumerate(entries):
        req = {}
        for name, spec in specs.items():
            if name not in entry:
                raise InputError(f"--input-data {path}: entry {i} has no input '{name}'")
            v = entry[name]
            if isinstance(v, dict):
                arr = np.asarray(v.get("content", v.get("b64")), dtype=_dtype(spec["datatype"]))
                if "shape" in v:
                    arr = arr.reshape(v["shape"])
            else:
                arr = np.asarray(v, dtype=_dtype(spec["datatype"]))
                try:
                    shape = _dims(meta, spec, shapes or {}, batch)[
                        1 if meta.get("max_batch_size", 0) > 0 else 0:]
                except InputError:  # variable dims: the values as given
                    shape = None
                if shape is not None and arr.ndim <= 1 and arr.size == int(np.prod(shape)):
                    arr = arr.reshape(shape)
            req[name] = _fit(meta, spec, arr, batch)
        sets.append(req)
    return sets


def load(meta: dict, data: str = "random", shapes=None, batch: int = 1, seed: int = 0) -> list[dict]:
    """The request data sets of a run (requests cycle through them).

    data: 'random' | 'zero' | a .json file | a .npy file (the model's only input,
    or NAME=file.npy[,NAME=file.npy]) | a directory of NAME.npy files."""
    shapes = shapes or {}
    if data in ("random", "zero", "zeros"):
        return [generate(meta, data, shapes, batch, seed)]
    specs = {s["name"]: s for s in meta["inputs"]}
    if "=" in data:
        files = dict(kv.split("=", 1) for kv in data.split(","))
    else:
        path = Path(data)
        if path.suffix == ".json":
            return from_json(meta, path, shapes, batch)
        if path.is_dir():
            files = {n: str(path / f"{n}.npy") for n in specs}
        elif len(specs) == 1:
            files = {next(iter(specs)): data}
        else:
            raise InputError(f"--input-data {data}: model has {len(specs)} inputs; give "
                             "NAME=file.npy,... or a directory of NAME.npy files")
    base = generate(meta, "random", shapes, batch, seed) if set(files) != set(specs) else {}
    req = dict(base)
    for name, f in files.items():
        if name not in specs:
            raise InputError(f"--input-data: model has no input '{name}' (inputs: {', '.join(specs)})")
        try:
            req[name] = _fit(meta, specs[name], np.load(f, allow_pickle=False), batch)
        except (OSError, ValueError) as e:
            raise InputError(f"--input-data {name}={f}: {e}") from None
    return [req]
