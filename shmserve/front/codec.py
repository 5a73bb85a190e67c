"""KServe v2 / Open Inference Protocol bodies over HTTP, as Triton reads and writes them:
the JSON request (tensors as flat or nested lists) and the binary tensor data
extension (a JSON header of Inference-Header-Content-Length bytes, then each input
with a "binary_data_size" parameter, in order), and the response the same two ways.

Inputs sent as binary data are written from the body's chunks straight into arrays
of the front's shared arena (`empty`, Client.empty): the one copy on the way in.
Binary outputs go out as views of the arena: no copy on the way out.
"""
from __future__ import annotations

import json
import math

import numpy as np

from .. import protocol as P


class BadRequest(Exception):
    """The request is malformed: answered 400 with this text as Triton's {"error": ...}."""


class Unsupported(BadRequest):
    """The request asks for something this front does not serve (yet), named in the text."""


# Per-tensor parameters other than these are refused by name, so that nothing a caller
# asks for is silently ignored. Request-level parameters are Triton's: the reserved keys
# below are the front's or options of the request (priority, timeout, the sequence
# extension's sequence_id / sequence_start / sequence_end), any other goes to the model
# as a request parameter.
REQUEST_PARAMETERS = {"binary_data_output", "priority", "timeout", "sequence_id",
                      "sequence_start", "sequence_end"}
SHM_PARAMETERS = {"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"}
INPUT_PARAMETERS = {"binary_data_size"} | SHM_PARAMETERS
CLASSIFICATION = "classification"  # the classification extension's (classification.py)
OUTPUT_PARAMETERS = {"binary_data", CLASSIFICATION} | SHM_PARAMETERS


def request_options(header: dict) -> dict:
    """Client.infer's options from a request's `parameters` (checked by plan_inputs):
    priority and timeout (microseconds) as Triton's HTTP front maps them, sequence_id
    (integer or string), sequence_start and sequence_end (booleans) as its sequence
    extension does, every other key but binary_data_output as a request parameter for
    the model."""
    params = header.get("parameters") or {}
    options = {}
    for key, option in (("priority", "priority"), ("timeout", "timeout_us")):
        if key in params:
            value = params[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
                raise BadRequest(f"request: parameter '{key}' must be a non-negative integer, "
                                 f"got {value!r}")
            options[option] = value
    if "sequence_id" in params:
        value = params["sequence_id"]
        if isinstance(value, bool) or not isinstance(value, (int, str)) or \
                isinstance(value, int) and not 0 <= value < 1 << 64:
            raise BadRequest(f"request: parameter 'sequence_id' must be an unsigned integer or a "
                             f"string, got {value!r}")
        options["sequence_id"] = value
    for key in ("sequence_start", "sequence_end"):
        if key in params:
            if not isinstance(params[key], bool):
                raise BadRequest(f"request: parameter '{key}' must be a boolean, got {params[key]!r}")
            options[key] = params[key]
    custom = {k: v for k, v in params.items() if k not in REQUEST_PARAMETERS}
    if custom:
        try:
            P.encode_parameters(custom)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        options["parameters"] = custom
    return options


def check_parameters(params, allowed: set, where: str, front: str = "HTTP",
                     custom: bool = False) -> dict:
    """custom: keys neither allowed nor reserved are the caller's (request level)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: 'parameters' must be a JSON object")
    for key in params:
        if key in allowed or custom:
            continue
        raise Unsupported(f"{where}: parameter '{key}' is not supported by shmserve's {front} front")
    return params


def numpy_dtype(datatype, where: str) -> np.dtype:
    code = P.DTYPE_CODES.get(datatype) if isinstance(datatype, str) else None
    if code is None:
        raise BadRequest(f"{where}: unknown datatype '{datatype}' "
                         f"(one of {', '.join(P.DTYPE_CODES)})")
    try:
        return P.numpy_dtype(code)
    except (KeyError, TypeError):  # BF16 without ml_dtypes
        raise Unsupported(f"{where}: datatype {datatype} needs the ml_dtypes package "
                          "on the server") from None


def tensor_type(shape, datatype, where: str) -> tuple[tuple, np.dtype]:
    """A request tensor's shape (non-negative integers) and numpy dtype, checked; every
    front's decoder goes through it."""
    if (not isinstance(shape, list) or
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise BadRequest(f"{where}: 'shape' must be a list of non-negative integers, "
                         f"got {shape!r}")
    return tuple(shape), numpy_dtype(datatype, where)


def check_size(size: int, shape, datatype: str, dtype: np.dtype, what: str) -> None:
    """A fixed-size tensor's bytes must be exactly what its shape and type say."""
    expected = math.prod(shape) * dtype.itemsize
    if size != expected:
        raise BadRequest(f"{what}: shape {list(shape)} of {datatype} is {expected} bytes")


class InputTensor:
    """One input of a request: where its binary bytes go (`sink`, a writable uint8
    view), or its decoded JSON data, or the shared memory it is read from (`shm`:
    region, offset, byte_size; the front sets `value` from it, front/shm.py)."""

    __slots__ = ("name", "shape", "datatype", "dtype", "binary_size", "sink", "value",
                 "value_array", "shm")

    def finish(self):
        """The array the engine is given."""
        if self.value is not None:
            return self.value
        if self.datatype == "BYTES":
            try:
                return P.decode_bytes(self.sink, self.shape)
            except ValueError as e:
                raise BadRequest(f"input '{self.name}': {e}") from None
        return self.value_array


def shm_parameters(params: dict, where: str, name: str) -> tuple[str, int, int] | None:
    """(region, offset, byte_size) of a tensor's shared_memory_* parameters, or None."""
    if "shared_memory_region" not in params:
        for key in ("shared_memory_offset", "shared_memory_byte_size"):
            if key in params:
                raise BadRequest(f"'{key}' can not be specified without "
                                 f"'shared_memory_region' parameter for tensor '{name}'")
        return None
    region = params["shared_memory_region"]
    if not isinstance(region, str):
        raise BadRequest(f"{where}: Unable to parse 'shared_memory_region': expected a string")
    if "shared_memory_byte_size" not in params:
        raise BadRequest("'shared_memory_byte_size' must be specified along with "
                         f"'shared_memory_region' parameter for tensor '{name}'")
    values = []
    for key, default in (("shared_memory_offset", 0), ("shared_memory_byte_size", None)):
        v = params.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise BadRequest(f"{where}: Unable to parse '{key}': expected a non-negative "
                             f"integer, got {v!r}")
        values.append(v)
    return region, values[0], values[1]


def parse_header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(header, dict):
        raise BadRequest("failed to parse the request JSON buffer: not a JSON object")
    return header


def plan_inputs(header: dict, empty, binary_bytes: int | None = None,
                max_binary: int = 1 << 30) -> list[InputTensor]:
    """The inputs of a parsed request; binary ones get their sink (from `empty(shape,
    dtype)`, an arena array, for fixed-size types), JSON ones their array.
    binary_bytes: the length of the binary section when the body's length is known
    (the binary_data_size of the inputs must add up to it), else at most max_binary:
    nothing is allocated for sizes the body cannot hold."""
    check_parameters(header.get("parameters"), REQUEST_PARAMETERS, "request", custom=True)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("request has no 'inputs' (a non-empty JSON array)")
    declared = sum(p.get("binary_data_size", 0) for p in
                   (spec.get("parameters") for spec in inputs if isinstance(spec, dict))
                   if isinstance(p, dict) and isinstance(p.get("binary_data_size"), int))
    if binary_bytes is not None and declared != binary_bytes:
        raise BadRequest(f"the inputs' binary_data_size add up to {declared} bytes, the body "
                         f"holds {binary_bytes} after the JSON header")
    if declared > max_binary:
        raise BadRequest(f"the inputs' binary_data_size add up to {declared} bytes, more than "
                         f"the {max_binary} this server takes in one request")
    planned, seen = [], set()
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadRequest(f"input {i}: an object with a string 'name' is required")
        t = InputTensor()
        t.name = spec["name"]
        where = f"input '{t.name}'"
        if t.name in seen:
            raise BadRequest(f"{where} is given twice")
        seen.add(t.name)
        t.shape, t.dtype = tensor_type(spec.get("shape"), spec.get("datatype"), where)
        t.datatype = spec.get("datatype")
        params = check_parameters(spec.get("parameters"), INPUT_PARAMETERS, where)
        count = math.prod(t.shape)
        t.sink = t.value = None
        t.shm = shm_parameters(params, where, t.name)
        given = [k for k, on in (("'data'", "data" in spec),
                                 ("'binary_data_size'", "binary_data_size" in params),
                                 ("'shared_memory_region'", t.shm is not None)) if on]
        if len(given) > 1:  # Triton's words
            raise BadRequest("Input must set only one of the following fields: 'data', "
                             "'binary_data_size' in 'parameters', 'shared_memory_region' in "
                             f"'parameters'. But set {' '.join(given)}")
        if t.shm is not None:
            t.binary_size = 0
        elif "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"{where}: 'binary_data_size' must be a non-negative integer")
            t.binary_size = size
            if t.datatype == "BYTES":
                t.sink = memoryview(bytearray(size))
            else:
                check_size(size, t.shape, t.datatype, t.dtype, f"{where}: unexpected "
                           f"binary_data_size {size}")
                arr = empty(t.shape, t.dtype) if size else np.empty(t.shape, t.dtype)
                t.value_array = arr
                t.sink = memoryview(arr.reshape(-1).view(np.uint8))
        else:
            if "data" not in spec:
                raise BadRequest(f"{where}: has neither 'data' nor a 'binary_data_size' or "
                                 "'shared_memory_region' parameter")
            t.binary_size = 0
            t.value = json_array(spec["data"], t, count)
        planned.append(t)
    return planned


def json_array(data, t: InputTensor, count: int) -> np.ndarray:
    """A JSON input's array: data flat or nested (row-major), BYTES as strings."""
    where = f"input '{t.name}'"
    if t.datatype == "BYTES":
        flat = _flatten(data)
        if not all(isinstance(x, str) for x in flat):
            raise BadRequest(f"{where}: BYTES data must be strings")
        arr = np.empty(len(flat), dtype=object)
        arr[:] = [x.encode() for x in flat]
    else:
        flat = _flatten(data)
        # numpy would truncate 1.5 to an integer, or take "1" as a number: refused instead
        if t.datatype == "BOOL":
            ok = all(isinstance(x, bool) for x in flat)
        elif t.dtype.kind in "iu":
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in flat)
        else:
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat)
        if not ok:
            raise BadRequest(f"{where}: data is not {t.datatype}: every element must be "
                             + ("true or false" if t.datatype == "BOOL" else "a number"
                                if t.dtype.kind == "f" else "an integer"))
        try:
            arr = np.asarray(flat, dtype=t.dtype)
        except (ValueError, TypeError, OverflowError) as e:
            raise BadRequest(f"{where}: data is not {t.datatype}: {e}") from None
    if arr.size != count:
        raise BadRequest(f"{where}: shape {list(t.shape)} needs {count} elements, data has "
                         f"{arr.size}")
    return arr.reshape(t.shape)


def _flatten(data) -> list:
    if not isinstance(data, list):
        return [data]
    out = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


class BinaryFiller:
    """Routes the body's bytes after the JSON header into the binary inputs' sinks, in
    the order the inputs are listed; complains of a short or long binary section."""

    def __init__(self, inputs: list[InputTensor]):
        self.targets = [t for t in inputs if t.binary_size]
        self.index, self.pos = 0, 0

    def feed(self, chunk) -> None:
        mv = memoryview(chunk)
        while mv:
            if self.index >= len(self.targets):
                raise BadRequest("unexpected additional input data: the body is longer than "
                                 "the JSON header and the binary_data_size of its inputs")
            t = self.targets[self.index]
            n = min(len(mv), t.binary_size - self.pos)
            t.sink[self.pos:self.pos + n] = mv[:n]
            self.pos += n
            mv = mv[n:]
            if self.pos == t.binary_size:
                self.index, self.pos = self.index + 1, 0

    def close(self) -> None:
        if self.index < len(self.targets):
            t = self.targets[self.index]
            raise BadRequest(f"unexpected end of input data: input '{t.name}' declares "
                             f"binary_data_size {t.binary_size}, the body holds {self.pos} of them")


def shm_outputs(header: dict) -> dict[str, tuple[str, int, int]]:
    """The outputs asked for in shared memory: {name: (region, offset, byte_size)}
    (called after wanted_outputs, which checked the list's shape)."""
    targets = {}
    for spec in header.get("outputs") or []:
        params = spec.get("parameters") or {}
        where = f"output '{spec['name']}'"
        target = shm_parameters(params, where, spec["name"])
        if target is None:
            continue
        if params.get("binary_data") is True:
            raise BadRequest("Output can't set both 'shared_memory_region' and 'binary_data'")
        targets[spec["name"]] = target
    return targets


def class_counts(outputs, where_of=lambda name: f"output '{name}'") -> dict[str, int]:
    """{name: k} of the outputs asked for with the classification extension's
    parameter; outputs: [(name, parameters)] (checked by check_parameters)."""
    counts = {}
    for name, params in outputs:
        if CLASSIFICATION in params:
            k = params[CLASSIFICATION]
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise BadRequest(f"{where_of(name)}: parameter 'classification' must be a "
                                 f"positive integer (the number of classes), got {k!r}")
            counts[name] = k
    return counts


def wanted_outputs(header: dict) -> tuple[list[str] | None, dict]:
    """Names of the outputs asked for (None: all) and, per name, whether it goes back
    as binary data (else the request's binary_data_output, default JSON)."""
    default = bool((header.get("parameters") or {}).get("binary_data_output", False))
    outputs = header.get("outputs")
    if outputs is None:
        return None, {"*": default}
    if not isinstance(outputs, list):
        raise BadRequest("'outputs' must be a JSON array")
    names, binary = [], {"*": default}
    for i, spec in enumerate(outputs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadRequest(f"output {i}: an object with a string 'name' is required")
        where = f"output '{spec['name']}'"
        params = check_parameters(spec.get("parameters"), OUTPUT_PARAMETERS, where)
        names.append(spec["name"])
        binary[spec["name"]] = bool(params.get("binary_data", default))
    return names, binary


def _json_values(arr: np.ndarray, datatype: str) -> list:
    flat = arr.reshape(-1)
    if datatype == "BYTES":
        out = []
        for x in flat:
            b = x if isinstance(x, bytes) else bytes(x)
            try:
                out.append(b.decode())
            except UnicodeDecodeError:  # Triton sends such bytes as binary data only
                raise BadRequest("an output of BYTES that are not UTF-8 text can only be "
                                 "returned as binary data (binary_data: true)") from None
        return out
    if datatype in ("FP16", "BF16"):
        return flat.astype(np.float32).tolist()
    return flat.tolist()


def encode_response(result, datatypes: dict, binary: dict, request_id,
                    in_shm: dict | None = None) -> tuple[list, int | None]:
    """(body parts, JSON header length or None when no output is binary). Parts after
    the JSON header are views of the arena (they keep the result's memory alive).
    Outputs written to shared memory (in_shm: {name: (region, bytes written)}) are
    listed without data, their parameters naming the region and the bytes written."""
    outputs, tails = [], []
    for name in result:
        arr = result[name]
        datatype = datatypes[name]
        entry = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if in_shm and name in in_shm:
            region, nbytes = in_shm[name]
            entry["parameters"] = {"shared_memory_region": region,
                                   "shared_memory_byte_size": nbytes}
        elif binary.get(name, binary["*"]):
            if datatype == "BYTES":
                data = P.encode_bytes(arr)
            else:
                data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            entry["parameters"] = {"binary_data_size": len(data)}
            tails.append(data)
        else:
            entry["data"] = _json_values(arr, datatype)
        outputs.append(entry)
    body = {"model_name": result.model_name, "model_version": str(result.model_version),
            "outputs": outputs}
    if request_id is not None:
        body["id"] = request_id
    head = json.dumps(body, separators=(",", ":")).encode()
    return [head, *tails], (len(head) if tails else None)
