"""BLS (business logic scripting): a model's requests to other models of its server.

The worker process is a client of its own server: at its first BLS request it opens a
shmserve.Client on the server's control socket (one lease, kept until the model is
finalized), so a BLS request takes the same shared-memory path as any caller's
(ring, batcher, the callee's workers) and its outputs come back as views of the
worker's arena. Errors come back as InferenceResponse.error(), never raised.

Limit: while a BLS request waits, the instance that sent it executes nothing else.
A request that needs that very instance (a model calling itself, or A -> B -> A) can
only be served by another instance of the model. A model with one instance calling
itself is refused at once; any other wait ends after the request's `timeout`
(microseconds, as Triton's) or DEFAULT_TIMEOUT_S, with an error saying why.
"""
from __future__ import annotations

import asyncio
import threading

from ..errors import ServerTimeoutError, ShmServeError
from . import messages
from .errors import TritonError, code_of
from .tensor import Tensor

DEFAULT_TIMEOUT_S = 60.0  # a BLS request without its own timeout waits at most this long


class _Context:
    """The calling model instance: set by the python backend when the model loads."""

    def __init__(self, model: str, instances: int, server: str, socket: str | None):
        self.model, self.instances = model, instances
        self.server, self.socket = server, socket
        self.client = None
        self.lock = threading.Lock()


_context: _Context | None = None


def bind(model: str, instances: int, server: str, socket: str | None) -> None:
    global _context
    _context = _Context(model, instances, server, socket)


def close() -> None:
    """Ends the BLS lease (the model was finalized)."""
    global _context
    ctx, _context = _context, None
    if ctx is not None and ctx.client is not None:
        ctx.client.close()


def _client():
    ctx = _context
    with ctx.lock:
        if ctx.client is None:
            from ..client import Client  # the caller's side, only in models that use BLS

            ctx.client = Client(ctx.server, socket_path_=ctx.socket)
        return ctx.client


def _refused(request) -> "messages.InferenceResponse | None":
    """A request that cannot be sent: the error response that says why."""
    ctx = _context
    if ctx is None:
        return _error(TritonError.UNAVAILABLE, f"BLS request to model '{request._model_name}': "
                      "only a model served by shmserve can send BLS requests")
    if request._model_name == ctx.model and ctx.instances == 1:
        return _error(TritonError.UNAVAILABLE,
                      f"BLS request from model '{ctx.model}' to itself: its only instance is "
                      "the one waiting for the answer, so it would never be served (give the "
                      "model more instances: instance_group count)")
    return None


def _timeout_s(request) -> float:
    return request._timeout_us / 1e6 if request._timeout_us > 0 else DEFAULT_TIMEOUT_S


def _send_args(request) -> tuple:
    inputs = {t._name: t._array for t in request.inputs()}
    version = request._model_version if request._model_version > 0 else None
    return request._model_name, inputs, request._requested or None, version


def _options(request) -> dict:
    """The request options a BLS request forwards: its parameters, as Triton's request
    timeout its timeout (microseconds) for the queue too, and its correlation id and
    sequence flags (a sequence model's requests)."""
    flags = request._flags
    return {"parameters": request._parameters or None, "timeout_us": max(request._timeout_us, 0),
            "sequence_id": request._correlation_id,
            "sequence_start": bool(flags & messages.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
            "sequence_end": bool(flags & messages.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)}


def execute(request) -> "messages.InferenceResponse":
    refused = _refused(request)
    if refused is not None:
        return refused
    model, inputs, outputs, version = _send_args(request)
    try:
        result = _client().infer(model, inputs, outputs, version, timeout=_timeout_s(request),
                                 **_options(request))
    except ServerTimeoutError:
        return _timed_out(request)
    except ShmServeError as e:
        return _failed(request, e)
    return _response(result)


async def execute_async(request) -> "messages.InferenceResponse":
    refused = _refused(request)
    if refused is not None:
        return refused
    model, inputs, outputs, version = _send_args(request)
    try:
        future = _client().submit(model, inputs, outputs, version, **_options(request))
        result = await asyncio.wait_for(asyncio.wrap_future(future), _timeout_s(request))
    except asyncio.TimeoutError:
        return _timed_out(request)
    except ShmServeError as e:
        return _failed(request, e)
    return _response(result)


def _response(result) -> "messages.InferenceResponse":
    # Views of the worker's arena: valid while the tensors live (no copy)
    return messages.InferenceResponse([Tensor(name, arr) for name, arr in result.items()])


def _error(code: int, message: str) -> "messages.InferenceResponse":
    return messages.InferenceResponse(error=TritonError(message, code))


def _failed(request, e: ShmServeError) -> "messages.InferenceResponse":
    message = e.msg
    if _context.client is None:  # could not even connect
        message = (f"BLS request to model '{request._model_name}': cannot reach server "
                   f"'{_context.server}' ({e.msg}); BLS requests can be sent once the server "
                   "serves, from execute() (not from initialize() at server start)")
    return _error(code_of(e.code), message)


def _timed_out(request) -> "messages.InferenceResponse":
    ctx = _context
    return _error(TritonError.UNAVAILABLE,
                  f"BLS request from model '{ctx.model}' to model '{request._model_name}' got "
                  f"no answer within {_timeout_s(request):g} s; if '{request._model_name}' needs "
                  f"the instance of '{ctx.model}' that is waiting (a call back into it, directly "
                  "or through other models) it cannot be served: give the model more instances "
                  "(instance_group count), or set InferenceRequest(timeout=...) (microseconds)")
