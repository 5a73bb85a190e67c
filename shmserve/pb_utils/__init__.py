"""Triton's python model API, as `import triton_python_backend_utils as pb_utils`
gives it inside a python model served by shmserve (the python backend registers this
module under that name before it loads model.py).

Implemented: TritonPythonModel's initialize(args) / execute(requests) / finalize() /
auto_complete_config(), Tensor (numpy, DLPack), InferenceRequest (inputs,
requested_output_names, parameters, BLS exec / async_exec, a decoupled model's
get_response_sender() and is_cancelled()), InferenceResponse, InferenceResponseSender,
TritonError with its codes, TritonModelException, Logger, the config and tensor
lookups and the data type helpers. What shmserve does not implement (BLS calls to
decoupled models, model loading from a model, custom metrics, ...) raises
NotImplementedByShmserve naming it where it is used: never a silent no-op.
See docs/architecture.md, "Python models".
"""
from __future__ import annotations

from .config import (ModelConfig, get_input_config_by_name, get_output_config_by_name,
                     using_decoupled_model_transaction_policy)
from .errors import NotImplementedByShmserve, TritonError, TritonModelException, unsupported
from .logger import Logger, LogLevel
from .messages import (TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
                       TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                       TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
                       TRITONSERVER_RESPONSE_COMPLETE_FINAL, InferenceRequest, InferenceResponse,
                       InferenceResponseSender, get_input_tensor_by_name,
                       get_output_tensor_by_name)
from .tensor import (Tensor, deserialize_bytes_tensor, numpy_to_triton_type,
                     serialize_byte_tensor, triton_string_to_numpy, triton_to_numpy_type)

MODULE_NAME = "triton_python_backend_utils"  # the name model code imports

# Triton's API that shmserve does not implement: each raises, naming itself.
load_model = unsupported("pb_utils.load_model()", "model control from a model")
unload_model = unsupported("pb_utils.unload_model()", "model control from a model")
is_model_ready = unsupported("pb_utils.is_model_ready()", "model control from a model")


class _Unsupported:
    """A class of Triton's API that shmserve does not implement: constructing one raises."""

    feature, why = "", ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedByShmserve(self.feature, self.why)


def _unsupported_class(name: str, why: str, **attrs) -> type:
    return type(name, (_Unsupported,), {"feature": f"pb_utils.{name}", "why": why, **attrs})


MetricFamily = _unsupported_class("MetricFamily", "custom metrics", COUNTER=0, GAUGE=1,
                                  HISTOGRAM=2)
Metric = _unsupported_class("Metric", "custom metrics")
PreferredMemory = _unsupported_class("PreferredMemory", "tensors are host memory")
InferenceTrace = _unsupported_class("InferenceTrace", "request tracing")
ResponseIterator = _unsupported_class("ResponseIterator", "BLS calls to decoupled models")
TRITONSERVER_MEMORY_CPU, TRITONSERVER_MEMORY_GPU = 0, 2  # PreferredMemory's arguments


def __getattr__(name: str):
    raise AttributeError(f"module '{MODULE_NAME}' (shmserve's Triton python model API) has no "
                         f"attribute '{name}'")


__all__ = ["ModelConfig", "get_input_config_by_name", "get_output_config_by_name",
           "using_decoupled_model_transaction_policy", "NotImplementedByShmserve", "TritonError",
           "TritonModelException", "Logger", "LogLevel", "InferenceRequest",
           "InferenceResponse", "get_input_tensor_by_name", "get_output_tensor_by_name", "Tensor",
           "deserialize_bytes_tensor", "numpy_to_triton_type", "serialize_byte_tensor",
           "triton_string_to_numpy", "triton_to_numpy_type", "load_model", "unload_model",
           "is_model_ready", "MetricFamily", "Metric", "PreferredMemory", "InferenceTrace",
           "InferenceResponseSender", "ResponseIterator",
           "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
           "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITONSERVER_REQUEST_RELEASE_ALL",
           "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE", "TRITONSERVER_MEMORY_CPU",
           "TRITONSERVER_MEMORY_GPU"]
