"""What the HTTP and gRPC fronts answer alike, whatever the wire: Triton's words for a
model it does not serve or a decoupled model on an endpoint that answers once, server
readiness, a model's metadata, which model versions are decoupled."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

# The extensions the fronts serve, by Triton's names (GET /v2, ServerMetadata).
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "system_shared_memory",
              "model_repository", "classification", "trace", "logging"]
CONTROL_TIMEOUT_S = 10.0  # a control call not answered by then: 503/UNAVAILABLE, never a hang
# glibc's malloc tuned for a front (keep_large_buffers): blocks up to this size come
# from the heap, never from a fresh mmap, and a freed heap is kept up to TRIM bytes.
MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit
MALLOC_TRIM_THRESHOLD_BYTES = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)

log = logging.getLogger("shmserve.front")


def keep_large_buffers() -> bool:
    """Every request body and answer of a front is a buffer as large as its tensors
    (grpcio's message, protobuf's, the encoded answer), allocated and freed once per
    request. glibc serves blocks over 128 KiB with a fresh mmap, or trims the heap
    back after them, so each one starts with a page fault per 4 KiB page: on a virtual
    machine most of a 1 MiB request's time in the front (bench/README.md,
    "http_vs_triton.py"). Keeping them in the heap makes them reused memory. False
    where the C library is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.warning("front: mallopt refused the large-buffer settings; large requests "
                    "will pay a page fault per page")
    return ok


def not_found_message(model: str, version) -> str:
    """Triton's words for a model (or version) it does not serve."""
    what = f"'{model}'" if version is None else f"'{model}' version {version}"
    return f"Request for unknown model: {what} is not found"


def decoupled_refused(endpoint: str, model: str) -> str:
    """Triton's words for a decoupled model (0..n responses per request) sent to an
    endpoint that answers each request once (endpoint: "ModelInfer RPC", "HTTP end
    point"), naming the model and the way that serves it."""
    return (f"{endpoint} doesn't support models with decoupled transaction policy: model "
            f"'{model}' is decoupled (model_transaction_policy decoupled); stream its responses "
            "with the gRPC ModelStreamInfer RPC (tritonclient.grpc: start_stream, "
            "async_stream_infer)")


def server_ready(models: list[dict]) -> bool:
    """Ready: the server serves models and every one of them is READY."""
    return bool(models) and all(m["state"] == "READY" for m in models)


def parse_version(model: str, text: str) -> int | None:
    """A request's model version: "" or "0" is the highest (None), as Triton takes it;
    ValueError names anything else that is not a non-negative integer."""
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"model '{model}': version '{text}' is not a non-negative integer")
    return int(text) or None


def model_metadata(meta: dict, models: list[dict] | None) -> dict:
    """The metadata extension's answer; models: every (model, version) the server
    lists, when the request named no version (then all of the model's are listed)."""
    if models is None:
        versions = [meta["version"]]
    else:
        versions = sorted(m["version"] for m in models if m["name"] == meta["name"])
    return {"name": meta["name"], "versions": [str(v) for v in versions],
            "platform": meta["platform"],
            "inputs": [{k: t[k] for k in ("name", "datatype", "shape")} for t in meta["inputs"]],
            "outputs": [{k: t[k] for k in ("name", "datatype", "shape")} for t in meta["outputs"]]}
