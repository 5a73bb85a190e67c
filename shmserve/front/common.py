"""What the HTTP and gRPC fronts answer alike, whatever the wire: Triton's words for a
model it does not serve or a decoupled model on an endpoint that answers once, server
readiness, a model's metadata, which model versions are decoupled."""
from __future__ import annotations

# The extensions the fronts serve, by Triton's names (GET /v2, ServerMetadata).
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "system_shared_memory",
              "model_repository", "classification", "trace", "logging"]
CONTROL_TIMEOUT_S = 10.0  # a control call not answered by then: 503/UNAVAILABLE, never a hang


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
