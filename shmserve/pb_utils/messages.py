"""pb_utils.InferenceRequest and pb_utils.InferenceResponse.

One InferenceRequest class serves both ways, as in Triton: the requests execute()
receives (built by the backend, inputs viewing the callers' shared memory) and the
BLS requests a model builds to call another model (exec() / async_exec(), bls.py).

What a model touches per request is C (csrc/pb_types.c): both types, made from the
classes of their Python methods below, with their fields; the requests execute()
receives built (received), get_input_tensor_by_name, the responses turned back into
arrays (response_arrays).
"""
from __future__ import annotations

import json
import weakref

from .. import _core
from ..protocol import Status, encode_parameters
from . import bls
from .errors import NotImplementedByShmserve, TritonError, TritonModelException, status_of
from .tensor import Tensor

# Triton's flag values, for code that reads or passes them
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_NO_PARAMETERS = "{}"


class _InferenceRequestMethods:
    """pb_utils.InferenceRequest(model_name=..., inputs=[Tensor...],
    requested_output_names=[...], model_version=-1, ...).exec(): the class
    InferenceRequest is made from (below), the C type adding its fields, of the names
    __init__ sets."""

    # A request execute() receives holds _by_name, {input name: Tensor}: one lookup for
    # get_input_tensor_by_name; one a model builds holds _inputs, the list it was given.
    __slots__ = ()

    def __init__(self, model_name: str = "", inputs=(), requested_output_names=(),
                 model_version: int = -1, request_id: str = "", correlation_id=0,
                 flags: int = 0, timeout: int = 0, preferred_memory=None, trace=None,
                 parameters=None):
        if not isinstance(model_name, str) or not model_name:
            raise TritonModelException("pb_utils.InferenceRequest: model_name must be a "
                                       f"non-empty str, got {model_name!r}")
        inputs = list(inputs)
        for t in inputs:
            if not isinstance(t, Tensor):
                raise TritonModelException(
                    f"pb_utils.InferenceRequest('{model_name}'): inputs must be pb_utils.Tensor "
                    f"objects, got {type(t).__name__}")
        if isinstance(requested_output_names, str):
            raise TritonModelException(
                f"pb_utils.InferenceRequest('{model_name}'): requested_output_names must be a "
                f"list of names, got the str {requested_output_names!r}")
        if flags & ~(TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | TRITONSERVER_REQUEST_FLAG_SEQUENCE_END):
            raise TritonModelException(f"pb_utils.InferenceRequest('{model_name}'): flags {flags:#x} "
                                       "set bits other than SEQUENCE_START and SEQUENCE_END")
        if isinstance(parameters, str):  # Triton takes a JSON object string too
            try:
                parameters = json.loads(parameters)
            except ValueError as e:
                raise TritonModelException(f"pb_utils.InferenceRequest('{model_name}'): "
                                           f"parameters is not a JSON object: {e}") from None
        parameters = dict(parameters or {})
        try:
            encode_parameters(parameters)
        except (TypeError, ValueError) as e:
            raise TritonModelException(f"pb_utils.InferenceRequest('{model_name}'): {e}") from None
        if preferred_memory is not None:
            raise NotImplementedByShmserve("pb_utils.InferenceRequest(preferred_memory=...)",
                                           "BLS outputs are host memory")
        if trace is not None:  # request.trace() is None here: passing it on is fine
            raise NotImplementedByShmserve("pb_utils.InferenceRequest(trace=...)",
                                           "request tracing")
        self._model_name = model_name
        self._inputs = inputs
        self._by_name = None
        self._requested = list(requested_output_names)
        self._model_version = int(model_version)
        self._request_id = str(request_id)
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout_us = int(timeout)
        self._parameters = parameters
        self._stream = self._sender = None

    # -- what a request holds -----------------------------------------------------
    def inputs(self) -> list:
        return self._inputs if self._by_name is None else list(self._by_name.values())

    def requested_output_names(self) -> list:
        return list(self._requested)  # the worker's may be a shared tuple: a list to keep

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout_us

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as Triton gives them
        (the caller's request parameters: name -> bool / int / float / str)."""
        return json.dumps(self._parameters) if self._parameters else _NO_PARAMETERS

    def is_cancelled(self) -> bool:
        """True once the caller of a decoupled model's request cancelled it or left; a
        request of a model that is not decoupled is never cancelled (it runs to its
        answer)."""
        return self._stream is not None and self._stream.cancelled()

    def trace(self):
        return None

    def set_release_flags(self, flags: int) -> None:
        if flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise NotImplementedByShmserve("request.set_release_flags(RESCHEDULE)",
                                           "requests are not rescheduled")

    def get_response_sender(self) -> "InferenceResponseSender":
        """The sender of this request's responses (a decoupled model's; the same
        object every call)."""
        if self._stream is None:
            raise TritonModelException(
                "request.get_response_sender(): the model is not decoupled (its config has "
                "no model_transaction_policy { decoupled: true }): execute() returns one "
                "response per request" if self._model_name == "" else
                f"request.get_response_sender(): a BLS request to '{self._model_name}' has no "
                "response sender; it is answered by exec()")
        if self._sender is None:
            self._sender = InferenceResponseSender(self._stream)
        return self._sender

    # -- BLS -------------------------------------------------------------------------
    def exec(self, decoupled: bool = False) -> "InferenceResponse":
        """Runs this request on its model through the server (bls.py) and returns
        its InferenceResponse; errors come back as response.error(), never raised."""
        if decoupled:
            raise NotImplementedByShmserve("InferenceRequest.exec(decoupled=True)",
                                           "BLS calls to decoupled models; a model calls them "
                                           "through shmserve.Client.infer_stream")
        return bls.execute(self)

    async def async_exec(self, decoupled: bool = False) -> "InferenceResponse":
        """exec() for `async def execute`: await it (or asyncio.gather several)."""
        if decoupled:
            raise NotImplementedByShmserve("InferenceRequest.async_exec(decoupled=True)",
                                           "BLS calls to decoupled models; a model calls them "
                                           "through shmserve.Client.infer_stream")
        return await bls.execute_async(self)


InferenceRequest = _core.pb_request_type(_InferenceRequestMethods)

# The requests execute() receives, from the backend's (inputs as {name: array} or
# (name, array) pairs, requested output names, parameters dict) per request: no checks (the batcher
# validated them), a Tensor per input.
received = _core.pb_received


def received_with_streams(requests) -> list:
    """A decoupled model's requests: received's, each with its ResponseStream last
    (server/stream.py), which the request's response sender sends through."""
    out = received([r[:3] for r in requests])
    for r, request in zip(out, requests):
        r._stream = request[3]
    return out


class InferenceResponseSender:
    """pb_utils.InferenceResponseSender: request.get_response_sender() of a decoupled
    model. send() may be called from any thread, during execute() or after it."""

    __slots__ = ("_stream", "__weakref__")

    def __init__(self, stream):
        self._stream = stream
        # A sender dropped before its final flag would leave its caller waiting: its
        # request is ended with an error naming the cause instead.
        weakref.finalize(self, _dropped, stream).atexit = False

    def send(self, response: "InferenceResponse | None" = None, flags: int = 0) -> None:
        """Sends one response to the caller; flags TRITONSERVER_RESPONSE_COMPLETE_FINAL
        makes it the last (a final send may carry no response)."""
        if flags & ~TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            raise TritonModelException(f"InferenceResponseSender.send: flags {flags:#x} set bits "
                                       "other than TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        outputs = error = None
        if response is None:
            if not final:
                raise TritonModelException("InferenceResponseSender.send: a response is needed "
                                           "unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        elif type(response) is not InferenceResponse:
            raise TritonModelException("InferenceResponseSender.send: response must be a "
                                       f"pb_utils.InferenceResponse, got {type(response).__name__}")
        elif response._error is not None:
            error = (status_of(response._error), response._error.message())
        else:
            outputs = {}
            for t in response._outputs:
                if type(t) is not Tensor:
                    raise TritonModelException("InferenceResponseSender.send: the response holds "
                                               f"a {type(t).__name__}, not a pb_utils.Tensor")
                outputs[t._name] = t._array
        try:
            self._stream.send(outputs, error, final)
        except RuntimeError:
            raise TritonModelException("InferenceResponseSender.send: this request's final "
                                       "response was sent already (flags "
                                       "TRITONSERVER_RESPONSE_COMPLETE_FINAL)") from None

    def is_cancelled(self) -> bool:
        """True once the caller cancelled the request or left: further responses are
        dropped; the model should stop and send the final flag."""
        return self._stream.cancelled()


def _dropped(stream) -> None:
    stream.fail(Status.INTERNAL, f"model '{stream.worker.spec.name}' released the response "
                "sender of a request without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL")


class _InferenceResponseMethods:
    """pb_utils.InferenceResponse(output_tensors=[Tensor...], error=None)'s methods: the
    class InferenceResponse is made from (below). The C type holds _outputs and _error."""

    __slots__ = ()

    @staticmethod
    def _checked(output_tensors, error, parameters) -> list:
        """The constructor's rare case (not a list, an error, parameters): its list of
        output tensors, or why the arguments are refused."""
        if output_tensors is None:
            output_tensors = []
        elif type(output_tensors) is not list:
            if not isinstance(output_tensors, (list, tuple)):
                raise TritonModelException("pb_utils.InferenceResponse: output_tensors must be a "
                                           f"list of pb_utils.Tensor, got "
                                           f"{type(output_tensors).__name__}")
            output_tensors = list(output_tensors)
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException("pb_utils.InferenceResponse: error must be a "
                                       f"pb_utils.TritonError, got {type(error).__name__}")
        if parameters:
            raise NotImplementedByShmserve("pb_utils.InferenceResponse(parameters=...)",
                                           "shmserve's protocol carries no response parameters")
        return output_tensors

    def output_tensors(self) -> list:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return _NO_PARAMETERS

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        return f"InferenceResponse({self._outputs!r})"


InferenceResponse = _core.pb_response_type(_InferenceResponseMethods)

# response_arrays(responses, n): per response, {output name: array} of one without
# error holding only Tensors, None for any other (the backend says why); None if
# responses is not a list or tuple of n.
response_arrays = _core.pb_response_arrays

# get_input_tensor_by_name(inference_request, name): the request's input Tensor called
# `name`, or None (a received request's in one dict lookup; any object with inputs()).
get_input_tensor_by_name = _core.pb_get_input_tensor_by_name


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output Tensor called `name`, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None
