"""config.pbtxt fields shmserve does not implement yet: never accepted in silence.

A field whose absence would change what a caller gets back is refused with a
ConfigError naming it; one that only changes when or how fast requests run (the response cache, pinned memory, CUDA graphs) is loaded
with a warning naming it. Everything else set in a config is implemented; a
backend's own parameters and options are checked by the backend (backends/).
"""
from __future__ import annotations

import logging

from ..model_config import mc

from ..errors import ConfigError

log = logging.getLogger("shmserve.repository")

# Top-level ModelConfig fields that are implemented (or, like platform/backend, checked
# elsewhere); `runtime` is a Triton backend library name, irrelevant here.
IMPLEMENTED = {"name", "platform", "backend", "runtime", "max_batch_size", "input", "output",
               "instance_group", "dynamic_batching", "parameters", "version_policy",
               "default_model_filename", "model_warmup", "optimization",
               "ensemble_scheduling",  # ensemble.py
               "sequence_batching",  # sequence_config.py
               "response_cache",  # response_cache.py
               "batch_input", "batch_output",  # ragged.py
               "model_transaction_policy"}  # decoupled: server/stream.py
# Set, these change results: refused.
REFUSED: set[str] = set()
DYNAMIC_IMPLEMENTED = {"preferred_batch_size", "max_queue_delay_microseconds",
                       "default_queue_policy", "priority_levels", "default_priority_level",
                       "priority_queue_policy", "preserve_ordering"}
TENSOR_IMPLEMENTED = {"name", "data_type", "dims", "reshape", "optional", "label_filename",
                      "allow_ragged_batch"}  # ragged.py
TENSOR_REFUSED = {"is_shape_tensor", "is_non_linear_format_io"}
# optimization: the onnxruntime backend applies graph and execution_accelerators
# (onnxruntime_backend.py); the other backends ignore them, as Triton's do.
OPTIMIZATION_BY_BACKEND = {"graph": {"onnxruntime"}, "execution_accelerators": {"onnxruntime"}}
GROUP_IMPLEMENTED = {"name", "kind", "count", "gpus"}  # server/devices.py


def _set_fields(message) -> list[str]:
    return [field.name for field, _ in message.ListFields()]


def check(cfg: mc.ModelConfig, where: str, backend: str | None = None) -> list[str]:
    """Raises ConfigError for the first field set in cfg that would change results;
    logs and returns a warning for each other field shmserve ignores (for `backend`,
    when given: optimization settings are per backend)."""
    warnings = []

    def ignored(path: str, why: str = "") -> None:
        warnings.append(f"{where}: {path} is not implemented by shmserve yet and is "
                        f"ignored{why}")

    for field in _set_fields(cfg):
        if field in REFUSED:
            raise ConfigError(f"{where}: {field} is not implemented by shmserve yet; serving "
                              "the model without it would change its results")
        if field not in IMPLEMENTED:
            ignored(field)
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        for t in tensors:
            for field in _set_fields(t):
                if field in TENSOR_REFUSED:
                    raise ConfigError(f"{where}: {kind} '{t.name}' {field} is not implemented "
                                      "by shmserve yet")
                if field not in TENSOR_IMPLEMENTED:
                    ignored(f"{kind} '{t.name}' {field}")
    for field in _set_fields(cfg.optimization):
        used_by = OPTIMIZATION_BY_BACKEND.get(field)
        if used_by is None:
            ignored(f"optimization {field}")
        elif backend is not None and backend not in used_by:
            warnings.append(f"{where}: optimization {field} is not used by the {backend} "
                            f"backend (as in Triton) and is ignored")
    for group in cfg.instance_group:
        for field in _set_fields(group):
            if field not in GROUP_IMPLEMENTED:
                ignored(f"instance_group {field}")
    if cfg.response_cache.enable and cfg.HasField("sequence_batching"):
        warnings.append(f"{where}: response_cache is not applied to a model with "
                        "sequence_batching (a cached answer would skip the sequence's state); "
                        "its requests always execute")
    elif cfg.response_cache.enable and cfg.platform == "ensemble":
        warnings.append(f"{where}: response_cache is not applied to an ensemble's own requests "
                        "yet; the steps' models cache theirs when their configs enable it")
    dyn = cfg.dynamic_batching
    for field in _set_fields(dyn):
        if field not in DYNAMIC_IMPLEMENTED:
            ignored(f"dynamic_batching {field}")
    for w in warnings:
        log.warning("%s", w)
    return warnings
