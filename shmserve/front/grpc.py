"""The gRPC front (`shmserve serve --grpc-port`): Triton's `inference.GRPCInferenceService`
(KServe v2 over gRPC) from the protos tritonclient ships, for tritonclient.grpc,
perf_analyzer and other callers that are not on this machine's shared memory.

    python -m shmserve.front.grpc   (started by the coordinator; boot message on stdin)

Like the HTTP front (http.py) a front is one process and one client lease of the
engine, on grpcio's asyncio server (on uvloop); several fronts (--grpc-infer-thread-count) bind
the port with SO_REUSEPORT (grpcio's default) and the kernel spreads connections over
them. Tensors are checked by codec.py, as the HTTP front's are; raw input contents go
from the message into the arena in one copy (the engine's), outputs go from the arena
into the serialized answer in one copy (encode_response writes the raw output contents'
wire format itself, rather than three copies through a protobuf message). Errors carry
Triton's status codes and words; a ModelStreamInfer request that fails is answered on
the stream with its error_message, as Triton does.

A decoupled model (model_transaction_policy decoupled: 0..n responses per request) is
served on ModelStreamInfer only, as in Triton: each response it sends is one message of
the stream (Service.stream), read from the engine by a thread of the front's pool
(Service.pump); ModelInfer refuses it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import signal
import threading

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc as pb_grpc

from .. import __version__, errors
from .. import protocol as P
from ..client import Client
from ..server.statistics import triton_only
from . import classification, codec
from .common import CONTROL_TIMEOUT_S, EXTENSIONS, decoupled_refused, keep_large_buffers, \
    model_metadata, not_found_message, parse_version, server_ready
from .shm import SystemSharedMemory

log = logging.getLogger("shmserve.front")

_CODES = {P.Status.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
          P.Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
          P.Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
          P.Status.BUSY: grpc.StatusCode.UNAVAILABLE,
          P.Status.SERVER_DEAD: grpc.StatusCode.UNAVAILABLE,
          P.Status.TIMEOUT: grpc.StatusCode.UNAVAILABLE}
# InferTensorContents' field for each datatype; FP16 and BF16 have none (raw only).
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
            "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
            "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
# RPCs of extensions shmserve does not serve yet: UNIMPLEMENTED, naming them.
NOT_YET: dict[str, str] = {}
LOAD_TIMEOUT_S = 600.0  # a load or unload waits for workers, or for a drain
# Triton's request parameter asking for the final flag of a decoupled model's request as
# an empty response when it comes alone, and the response parameter marking the last.
EMPTY_FINAL, FINAL_RESPONSE = "triton_enable_empty_final_response", "triton_final_response"
STREAM_POLL_S = 0.05  # a stream's reader looks whether its caller left this often
_END, _SENT = object(), object()  # a decoupled request was answered, was sent (Service.pump)

# Field numbers of what encode_response writes and read_infer_request reads itself
# (service.proto).
RAW_OUTPUT_CONTENTS = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
RAW_INPUT_CONTENTS = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
SPLIT_MIN_BYTES = 64 << 10  # smaller requests: protobuf's copies cost less than the split
STREAM_INFER_RESPONSE = pb.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(data, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]  # IndexError past the end: a truncated message
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def read_infer_request(data: bytes) -> tuple:
    """The ModelInfer / ModelStreamInfer deserializer: (ModelInferRequest, raw input
    contents). Of a large request the raw contents are views of the received bytes,
    split from the rest of the message by walking its top-level fields, and only the
    rest is parsed by protobuf: protobuf would copy each one twice (into its message,
    then into a new bytes at each access) before the engine copies it into the arena.
    A message the walk does not take (a wire type it does not expect, a truncated
    field) is parsed by protobuf as a whole, which words its error."""
    if len(data) >= SPLIT_MIN_BYTES:
        try:
            return _split_raw(data)
        except (ValueError, IndexError):
            pass
    message = pb.ModelInferRequest.FromString(data)
    return message, message.raw_input_contents


def _split_raw(data: bytes) -> tuple:
    view = memoryview(data)
    rest, raw = [], []
    i = start = 0  # start: the first byte of the fields not yet put in `rest`
    end = len(data)
    while i < end:
        field_at = i
        key, i = _read_varint(data, i)
        wire = key & 7
        if wire == 2:  # length-delimited
            length, i = _read_varint(data, i)
            if i + length > end:
                raise ValueError("field past the end")
            if key >> 3 == RAW_INPUT_CONTENTS:
                rest.append(view[start:field_at])
                raw.append(view[i:i + length])
                start = i + length
            i += length
        elif wire == 0:
            _, i = _read_varint(data, i)
        elif wire in (1, 5):  # fixed 64 / 32 bits
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")
    if i != end:
        raise ValueError("field past the end")
    rest.append(view[start:])
    return pb.ModelInferRequest.FromString(b"".join(rest)), raw


def _field(number: int, data) -> list:
    """A length-delimited protobuf field: key, length, then `data` (not copied here)."""
    return [_varint(number << 3 | 2) + _varint(len(data)), data]


def encode_response(result, datatypes: dict, request_id: str, in_shm: dict | None = None,
                    final: bool | None = None) -> bytes:
    """A serialized ModelInferResponse: its small fields through protobuf, then each
    output's raw_output_contents appended as wire-format fields straight from the
    arena (a parser merges repeated fields wherever they stand): one copy. An output
    written to shared memory (in_shm: {name: (region, bytes written)}) names its
    region and size in its parameters and has empty raw contents (tritonclient finds
    each output's raw contents by position). final: on a stream, whether this is the
    request's last response (Triton's triton_final_response parameter)."""
    head = pb.ModelInferResponse(model_name=result.model_name,
                                 model_version=str(result.model_version), id=request_id)
    if final is not None:
        head.parameters[FINAL_RESPONSE].bool_param = final
    parts = [None]
    for name in result:
        arr = result[name]
        out = head.outputs.add(name=name, datatype=datatypes[name], shape=arr.shape)
        if in_shm and name in in_shm:
            region, nbytes = in_shm[name]
            out.parameters["shared_memory_region"].string_param = region
            out.parameters["shared_memory_byte_size"].int64_param = nbytes
            parts += _field(RAW_OUTPUT_CONTENTS, b"")
            continue
        data = P.encode_bytes(arr) if datatypes[name] == "BYTES" else \
            memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        parts += _field(RAW_OUTPUT_CONTENTS, data)
    parts[0] = head.SerializeToString()
    return b"".join(parts)


def _set(future: asyncio.Future | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _final_response(request, final: bool = True) -> pb.ModelInferResponse:
    """A response of a stream without outputs: names the request it answers."""
    response = pb.ModelInferResponse(id=request.id, model_name=request.model_name,
                                     model_version=request.model_version)
    response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def _stream_error(request, message: str, final: bool | None = None) -> pb.ModelStreamInferResponse:
    """An error answered on a stream; final: of an error response a decoupled model sent."""
    if final is None:
        response = pb.ModelInferResponse(id=request.id, model_name=request.model_name,
                                         model_version=request.model_version)
    else:
        response = _final_response(request, final)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)


@dataclasses.dataclass
class Call:
    """A ModelInferRequest checked and decoded (Service.prepare)."""
    request: object  # the ModelInferRequest
    model: str
    version: int | None
    decoupled: bool  # the model streams its responses (model_transaction_policy)
    empty_final: bool  # triton_enable_empty_final_response
    arrays: dict
    names: list  # the outputs asked for; [] for all
    options: dict  # Client.infer's request options
    counts: dict  # {output: k} asked for as classes
    out_shm: dict  # {output: shared memory spec}
    targets: dict  # {output: where in shared memory it is written}


class GrpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _error(e: Exception) -> GrpcError:
    """Any failure of a request as the status Triton gives it."""
    if isinstance(e, GrpcError):
        return e
    if isinstance(e, codec.Unsupported):
        return GrpcError(grpc.StatusCode.UNIMPLEMENTED, str(e))
    if isinstance(e, codec.BadRequest):
        return GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, errors.ShmServeError):
        return GrpcError(_CODES.get(e.code, grpc.StatusCode.INTERNAL), e.msg)
    log.exception("gRPC request failed")  # a bug here: answered, logged, the front goes on
    return GrpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _parameters(params) -> dict:
    """A protobuf map of InferParameter as {key: value} (codec checks the keys)."""
    return {k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
            for k, v in params.items()}


def _version(model: str, text: str) -> int | None:
    try:
        return parse_version(model, text)
    except ValueError as e:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _typed_input(t, shape: tuple, dtype: np.dtype, where: str) -> np.ndarray:
    """An input given in InferTensorContents: the datatype's field only, with exactly
    the elements its shape holds, each in its type's range."""
    field = CONTENTS.get(t.datatype)
    given = [f.name for f, _ in t.contents.ListFields()]
    if field is None:
        raise codec.BadRequest(f"{where}: {t.datatype} has no typed contents field; send it "
                               "in raw_input_contents")
    stray = [name for name in given if name != field]
    if stray:
        raise codec.BadRequest(f"{where}: contents.{stray[0]} given for a {t.datatype} tensor "
                               f"(it goes in contents.{field})")
    values = getattr(t.contents, field)
    count = int(np.prod(shape))
    if len(values) != count:
        raise codec.BadRequest(f"{where}: shape {list(shape)} needs {count} elements, "
                               f"contents.{field} has {len(values)}")
    if t.datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr.reshape(shape)
    wide = np.asarray(values)  # int32/uint32 for the narrow integer types
    arr = wide.astype(dtype)
    if dtype.kind in "iu" and wide.dtype != dtype and (arr != wide).any():
        raise codec.BadRequest(f"{where}: contents.{field} holds values out of {t.datatype}'s range")
    return arr.reshape(shape)


def shm_regions(tensors, kind: str) -> dict:
    """{name: (region, offset, byte_size)} of the request's inputs or outputs (kind)
    whose parameters name a system shared memory region."""
    out = {}
    for t in tensors:
        if not t.parameters:  # the common case: nothing to check
            continue
        where = f"{kind} '{t.name}'"
        params = _parameters(t.parameters)
        allowed = codec.SHM_PARAMETERS | ({codec.CLASSIFICATION} if kind == "output" else set())
        codec.check_parameters(params, allowed, where, "gRPC")
        spec = codec.shm_parameters(params, where, t.name)
        if spec is not None:
            out[t.name] = spec
    return out


def decode_inputs(request, raw, in_shm: dict, read_shm=None) -> dict:
    """The request's inputs as {name: array}, checked by codec like the HTTP front's;
    raw: its raw_input_contents (read_infer_request), whose arrays are views (the
    engine copies them into the arena). An input in shared memory (in_shm, from
    shm_regions) is read by read_shm(name, spec, datatype, dtype, shape); raw contents
    then belong, in order, to the other inputs."""
    if not request.inputs:
        raise codec.BadRequest("request has no inputs")
    in_message = len(request.inputs) - len(in_shm)
    if raw and len(raw) != in_message:
        raise codec.BadRequest(f"the request has {in_message} inputs outside shared memory and "
                               f"{len(raw)} raw_input_contents: give one per such input, or none")
    arrays = {}
    k = 0  # the next raw_input_contents
    for t in request.inputs:
        where = f"input '{t.name}'"
        if t.name in arrays:
            raise codec.BadRequest(f"{where} is given twice")
        shape, dtype = codec.tensor_type(list(t.shape), t.datatype, where)
        if t.name in in_shm:
            if t.HasField("contents"):
                raise codec.BadRequest(f"{where}: has both contents and a shared memory region")
            arrays[t.name] = read_shm(t.name, in_shm[t.name], t.datatype, dtype, shape)
            continue
        if raw:
            if t.HasField("contents"):
                raise codec.BadRequest(f"{where}: has both contents and raw_input_contents")
            data = raw[k]
            k += 1
            if t.datatype == "BYTES":
                try:
                    arrays[t.name] = P.decode_bytes(data, shape)
                except ValueError as e:
                    raise codec.BadRequest(f"{where}: {e}") from None
                continue
            codec.check_size(len(data), shape, t.datatype, dtype,
                             f"{where}: raw_input_contents holds {len(data)} bytes")
            arrays[t.name] = np.frombuffer(data, dtype).reshape(shape)
        elif t.HasField("contents"):
            arrays[t.name] = _typed_input(t, shape, dtype, where)
        else:
            raise codec.BadRequest(f"{where}: has no data (neither contents nor "
                                   "raw_input_contents)")
    return arrays


class Service(pb_grpc.GRPCInferenceServiceServicer):
    """Triton's GRPCInferenceService over one lease of the engine."""

    def __init__(self, client: Client, max_in_flight: int):
        self.client = client
        # submit() waits (blocking) for a free slot: never ask for more than the lease holds
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.max_stream_in_flight = max_in_flight  # requests of one stream read ahead
        self.shm = SystemSharedMemory(client)  # the regions of every front (front/shm.py)
        self.labels = classification.Labels()
        # A decoupled request's reader (pump) waits in a thread for each response; one
        # each, never more than the slots (in_flight), nor in the control calls' pool.
        self.stream_threads = concurrent.futures.ThreadPoolExecutor(
            max_in_flight, thread_name_prefix="grpc-stream")
        self.closing = threading.Event()  # the front stops: readers stop draining

    async def control(self, fn, *args, timeout: float = CONTROL_TIMEOUT_S):
        """A control-plane call of the engine, in a thread, bounded in time."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, fn, *args), timeout)
        except asyncio.TimeoutError:
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "the server did not answer within "
                                                         f"{timeout:g} s") from None

    async def _answer(self, context, coro):
        try:
            return await coro
        except Exception as e:
            err = _error(e)
            await context.abort(err.code, err.message)

    # -- health and metadata ----------------------------------------------------------
    async def ServerLive(self, request, context):
        return await self._answer(context, self._live())

    async def _live(self):
        await self.control(self.client.models)  # the engine answers: live
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return await self._answer(context, self._ready())

    async def _ready(self):
        return pb.ServerReadyResponse(ready=server_ready(await self.control(self.client.models)))

    async def ModelReady(self, request, context):
        return await self._answer(context, self._model_ready(request))

    async def _model_ready(self, request):
        version = _version(request.name, request.version)
        try:
            meta = await self.control(self.client.model_metadata, request.name, version)
        except (errors.ModelNotFoundError, errors.UnavailableError):  # unknown, unloaded, broken
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=meta["state"] == "READY")

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="shmserve", version=__version__,
                                         extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        return await self._answer(context, self._metadata(request))

    async def _metadata(self, request):
        version = _version(request.name, request.version)
        try:
            meta = await self.control(self.client.model_metadata, request.name, version)
            models = None if version is not None else await self.control(self.client.models)
        except errors.ModelNotFoundError:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            not_found_message(request.name, version)) from None
        return json_format.ParseDict(model_metadata(meta, models), pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        return await self._answer(context, self._config(request))

    async def _config(self, request):
        from ..pb_utils.config import config_dict
        from ..server.repository import parse_config

        version = _version(request.name, request.version)
        try:
            text = await self.control(self.client.model_config, request.name, version)
        except errors.ModelNotFoundError:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            not_found_message(request.name, version)) from None
        config = json_format.ParseDict(config_dict(parse_config(text, f"model '{request.name}'")),
                                       model_config_pb2.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        return await self._answer(context, self._statistics(request))

    async def _statistics(self, request):
        model = request.name or None
        version = _version(request.name, request.version) if model else None
        try:
            stats = await self.control(self.client.statistics, model, version)
        except errors.ModelNotFoundError:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            not_found_message(request.name, version)) from None
        return json_format.ParseDict({"model_stats": [triton_only(s) for s in stats]},
                                     pb.ModelStatisticsResponse())

    # -- the model repository extension (--model-control-mode explicit) ----------------
    async def RepositoryIndex(self, request, context):
        return await self._answer(context, self._index(request))

    async def _index(self, request):
        rows = await self.control(self.client.get_model_repository_index, request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])

    async def RepositoryModelLoad(self, request, context):
        return await self._answer(context, self._load(request))

    async def _load(self, request):
        files = {k: p.bytes_param for k, p in request.parameters.items() if k.startswith("file:")}
        config = (request.parameters["config"].string_param
                  if "config" in request.parameters else None)
        await self.control(self.client.load_model, request.model_name, config, files or None,
                           timeout=LOAD_TIMEOUT_S)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        return await self._answer(context, self._unload(request))

    async def _unload(self, request):
        dependents = request.parameters.get("unload_dependents")
        await self.control(self.client.unload_model, request.model_name,
                           bool(dependents and dependents.bool_param), timeout=LOAD_TIMEOUT_S)
        return pb.RepositoryModelUnloadResponse()

    # -- inference ---------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        return await self._answer(context, self.infer(*request))

    async def infer(self, request, raw) -> bytes:
        """The serialized ModelInferResponse (the method's serializer passes bytes on).
        A decoupled model is refused, as Triton refuses it: it answers on streams only."""
        call = await self.prepare(request, raw)
        if call.decoupled:
            raise GrpcError(grpc.StatusCode.UNIMPLEMENTED,
                            decoupled_refused("ModelInfer RPC", call.model))
        return await self.infer_once(call)

    async def prepare(self, request, raw) -> Call:
        """The request checked and decoded (raw: its raw_input_contents, from
        read_infer_request), its inputs ready to send."""
        model = request.model_name
        version = _version(model, request.model_version)
        # Request parameters as the HTTP front maps them (Triton's): priority, timeout,
        # the sequence extension's, any other key the model's.
        params = _parameters(request.parameters) if request.parameters else {}
        empty_final = params.pop(EMPTY_FINAL, False)  # Triton's, not the model's
        if not isinstance(empty_final, bool):
            raise codec.BadRequest(f"invalid value type for '{EMPTY_FINAL}' parameter, "
                                   "expected bool_param")
        try:
            plan = self.client.engine.plan(model, version)
        except errors.ModelNotFoundError:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            not_found_message(model, version)) from None
        options = codec.request_options({"parameters": params}) if params else {}
        in_shm = shm_regions(request.inputs, "input")
        out_shm = shm_regions(request.outputs, "output")
        counts = codec.class_counts((o.name, _parameters(o.parameters))
                                    for o in request.outputs if o.parameters)
        targets = {}
        if in_shm or out_shm:
            if self.shm.needs_refresh():
                await self.control(self.shm.refresh)
            targets = {name: self.shm.output_target(*spec) for name, spec in out_shm.items()}

        def read_shm(name, spec, datatype, dtype, shape):
            return self.shm.read_input(*spec, name=name, datatype=datatype, dtype=dtype,
                                       shape=shape, model=model, empty=self.client.empty)

        arrays = decode_inputs(request, raw, in_shm, read_shm)
        return Call(request, model, version, plan.meta["decoupled"], empty_final, arrays,
                    [o.name for o in request.outputs], options, counts, out_shm, targets)

    async def infer_once(self, call: Call, final: bool | None = None,
                         sent: asyncio.Future | None = None) -> bytes:
        """One request, one answer (final: as encode_response's); `sent` is set once
        the request is on its way to the engine."""
        async with self.in_flight:
            try:
                try:
                    future = self.client.submit(call.model, call.arrays, call.names or None,
                                                call.version, **call.options)
                finally:
                    _set(sent)
                result = await asyncio.wrap_future(future)
            except errors.ModelNotFoundError:
                raise GrpcError(grpc.StatusCode.NOT_FOUND,
                                not_found_message(call.model, call.version)) from None
        return await self.encode(call, result, final)

    async def encode(self, call: Call, result, final: bool | None = None) -> bytes:
        """The serialized answer to `call` of one result (an InferResult, or a response
        of a stream): classified, its outputs written to shared memory where asked."""
        outputs = result  # as answered: classified outputs are their classes
        try:
            meta = self.client.engine.plan(call.model, call.version).meta
            datatypes = {t["name"]: t["datatype"] for t in meta["outputs"]}
            if call.counts:
                outputs = await classification.classified(
                    result, call.counts, meta, datatypes,
                    self.labels.of(meta, self.control, self.client))
            written = {name: (call.out_shm[name][0],
                              self.shm.write_output(target, name, outputs[name], datatypes[name]))
                       for name, target in call.targets.items() if name in outputs}
            return encode_response(outputs, datatypes, call.request.id, written, final)
        finally:
            result.release()  # the arena's block is free as soon as the bytes are copied

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request is answered on the stream as soon as it is done (requests run
        concurrently, as Triton's do, and a decoupled model's responses interleave with
        the others'); a failed one gets an error_message response and the stream goes
        on. Requests go to the engine in the stream's order (each waits until the one
        before it was sent: a sequence's requests keep their order, as in Triton). A
        caller that cancels the stream cancels its requests in flight."""
        answers: asyncio.Queue = asyncio.Queue()
        pending: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()

        async def one(received, after: asyncio.Future | None, sent: asyncio.Future):
            request = received[0]  # (ModelInferRequest, raw contents): read_infer_request
            try:
                call = await self.prepare(*received)
                if after is not None:
                    await after
                if call.decoupled:
                    await self.stream(call, answers.put, sent)
                    return
                answer = b"".join(_field(STREAM_INFER_RESPONSE,
                                         await self.infer_once(call, True, sent)))
            except Exception as e:
                answer = _stream_error(request, _error(e).message)
            finally:
                _set(sent)
            await answers.put(answer)

        async def read():
            try:
                sent = None  # the previous request's: set once it was sent
                async for received in request_iterator:
                    if len(pending) >= self.max_stream_in_flight:  # the caller waits (flow control)
                        await asyncio.wait(set(pending), return_when=asyncio.FIRST_COMPLETED)
                    after, sent = sent, loop.create_future()
                    task = asyncio.create_task(one(received, after, sent))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                while pending:
                    await asyncio.wait(set(pending))
            finally:
                await answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await reader  # raises what ended the reading (a broken stream)
        finally:
            reader.cancel()
            for task in list(pending):
                task.cancel()  # a decoupled request's task stops its model (stream())

    async def stream(self, call: Call, emit, sent: asyncio.Future | None = None) -> None:
        """A decoupled model's request: each response it sends is emitted (emit(answer))
        as one ModelStreamInferResponse, with Triton's triton_final_response parameter;
        an error response as an error_message, and the next ones follow. The final flag
        sent alone is emitted as an empty response only when the caller asked for it
        (triton_enable_empty_final_response), as Triton does. The responses are read by
        a thread of the front's own pool (pump) and handed to the loop; `sent` is set once
        the request is on its way. Cancelling this coroutine (the caller left) stops the
        model, and returns once its slot is free."""
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def deliver(item) -> None:
            try:
                loop.call_soon_threadsafe(responses.put_nowait, item)
            except RuntimeError:  # the loop closed: the front is stopping
                pass

        async with self.in_flight:  # the request holds a slot until its final flag
            pump = loop.run_in_executor(self.stream_threads, self.pump, call, deliver, stop)
            try:
                final_seen = False
                while (item := await responses.get()) is not _END:
                    if item is _SENT:
                        _set(sent)
                        continue
                    if isinstance(item, Exception):  # the request's own error
                        raise item
                    final_seen = item.final
                    if item.error is not None:  # an error response the model sent
                        item.release()
                        await emit(_stream_error(call.request, _error(item.error).message,
                                                 item.final))
                        continue
                    answer = await self.encode(call, item, item.final)
                    await emit(b"".join(_field(STREAM_INFER_RESPONSE, answer)))
                if call.empty_final and not final_seen:  # the final flag came alone
                    await emit(pb.ModelStreamInferResponse(infer_response=_final_response(
                        call.request)))
            finally:
                stop.set()
                await pump

    def pump(self, call: Call, deliver, stop: threading.Event) -> None:
        """In a thread: sends the request (then delivers _SENT) and delivers each
        response (StreamResponse), the request's error (an exception) and then _END.
        Once `stop` is set the model is asked to stop and the responses it still sends
        are dropped until its final flag, so the slot is free when this returns (or left
        to the engine's reaper, when the front stops first)."""
        stream = None
        try:
            stream = self.client.infer_stream(call.model, call.arrays, call.names or None,
                                              call.version, **call.options)
            deliver(_SENT)
            stopping = False
            while not (stopping and self.closing.is_set()):
                if not stopping and (stop.is_set() or self.closing.is_set()):
                    stream.stop()  # the model's is_cancelled() turns True
                    stopping = True
                try:
                    response = stream.poll(STREAM_POLL_S)
                except StopIteration:
                    break
                if response is not None and not stopping:
                    deliver(response)
        except Exception as e:  # noqa: BLE001 - the request's error, answered on the stream
            if not stop.is_set():
                deliver(e)
        finally:
            if stream is not None:
                stream.close()
            deliver(_END)

    # -- system shared memory (front/shm.py: one registry for every front) -------------
    async def SystemSharedMemoryStatus(self, request, context):
        return await self._answer(context, self._shm_status(request))

    async def _shm_status(self, request):
        rows = await self.control(self.shm.status, request.name or None)
        answer = pb.SystemSharedMemoryStatusResponse()
        for row in rows:
            answer.regions[row["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=row["name"], key=row["key"], offset=row["offset"],
                byte_size=row["byte_size"]))
        return answer

    async def SystemSharedMemoryRegister(self, request, context):
        return await self._answer(context, self._shm_register(request))

    async def _shm_register(self, request):
        if not request.name:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "'region name' is necessary to "
                                                              "register system shared memory region")
        await self.control(self.shm.register, request.name, request.key, request.offset,
                           request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        return await self._answer(context, self._shm_unregister(request))

    async def _shm_unregister(self, request):
        await self.control(self.shm.unregister, request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory needs a GPU build: as the HTTP front (http._cuda_shared_memory)
    async def CudaSharedMemoryStatus(self, request, context):
        if request.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory "
                                                           f"region: '{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"failed to register CUDA shared memory region: '{request.name}', "
                            "GPUs not supported: CUDA shared memory needs a GPU build of "
                            "shmserve (this one serves system shared memory only)")

    async def CudaSharedMemoryUnregister(self, request, context):
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and log settings ------------------------------------------------------------
    async def TraceSetting(self, request, context):
        return await self._answer(context, self._trace_setting(request))

    async def _trace_setting(self, request):
        """Triton's trace extension (global settings; server/settings.py): an empty
        value list sets a setting back to its value at start."""
        update = {key: list(value.value) or None for key, value in request.settings.items()}
        try:
            settings = await self.control(self.client.trace_settings, request.model_name or None,
                                          update or None)
        except errors.ModelNotFoundError:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            not_found_message(request.model_name, None)) from None
        response = pb.TraceSettingResponse()
        for key, values in settings.items():
            response.settings[key].value.extend(values)
        return response

    async def LogSettings(self, request, context):
        return await self._answer(context, self._log_settings(request))

    async def _log_settings(self, request):
        """Triton's logging extension (server/settings.py checks names and types)."""
        update = {}
        for key, value in request.settings.items():
            kind = value.WhichOneof("parameter_choice")
            if kind is None:
                raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"log setting '{key}' has no value")
            update[key] = getattr(value, kind)
        settings = await self.control(self.client.log_settings, update or None)
        response = pb.LogSettingsResponse()
        for key, value in settings.items():
            field = ("bool_param" if isinstance(value, bool) else
                     "uint32_param" if isinstance(value, int) else "string_param")
            setattr(response.settings[key], field, value)
        return response


def _unimplemented(rpc: str, extension: str):
    async def handler(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{rpc}: shmserve does not implement the {extension} yet")
    handler.__name__ = rpc
    return handler


for _rpc, _extension in NOT_YET.items():
    setattr(Service, _rpc, _unimplemented(_rpc, _extension))


def _serialize(message) -> bytes:
    """Inference answers come serialized already (encode_response); the rest are messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_service(service: Service, server) -> None:
    """service_pb2_grpc's registration, with _serialize as every method's serializer
    and read_infer_request as the inference methods' deserializer."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        kind = (grpc.stream_stream_rpc_method_handler if method.client_streaming
                else grpc.unary_unary_rpc_method_handler)
        read = (read_infer_request if method.input_type is pb.ModelInferRequest.DESCRIPTOR
                else getattr(pb, method.input_type.name).FromString)
        handlers[method.name] = kind(getattr(service, method.name), request_deserializer=read,
                                     response_serializer=_serialize)
    name = "inference.GRPCInferenceService"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def server_options(boot: dict) -> tuple[list, int]:
    """grpcio's channel arguments for the front: a message may be as large as the
    front's arena (no request can need more; larger ones are RESOURCE_EXHAUSTED),
    Triton's keep-alive flags as given, and the response compression level."""
    options = [("grpc.max_receive_message_length", boot["arena_bytes"]),
               ("grpc.max_send_message_length", -1),
               ("grpc.so_reuseport", 1)]
    grpc_options = boot.get("grpc_options", {})
    options += sorted(grpc_options.get("channel", {}).items())
    level = grpc_options.get("compression_level", 0)
    if level:  # grpc picks the algorithm among those the client accepts
        options.append(("grpc.default_compression_level", level))
    return options, level


async def serve(boot: dict, client: Client) -> None:
    from ..server.worker import report_load

    options, _ = server_options(boot)
    server = grpc.aio.server(options=options)
    service = Service(client, boot["slots_per_client"])
    add_service(service, server)
    address = boot["address"]
    target = f"[{address}]:{boot['port']}" if ":" in address else f"{address}:{boot['port']}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError as e:
        bound, why = 0, str(e)
    else:
        why = "grpc could not bind it"
    if not bound:
        report_load(boot, {"ready": False, "error": f"grpc {target}: {why}"})
        log.error("gRPC front %d: grpc %s: %s", boot["index"], target, why)
        raise SystemExit(3)
    await server.start()
    report_load(boot, {"ready": True})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop(*_):
        # The coordinator's shutdown may signal again while this front stops: ignored
        # from now on, in one step. (The loop's own signal handlers would put the
        # deadly default back when removed or when the loop closes: a window.)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):  # uvloop wakes for them (its wakeup fd)
        signal.signal(sig, on_stop)
    await stop.wait()
    service.closing.set()
    await server.stop(2)  # requests in flight get 2 s to finish, as the HTTP front's
    service.stream_threads.shutdown(wait=False, cancel_futures=True)


def main() -> None:
    import uvloop

    from ..server.maps import child_setup
    from ..server.worker import report_load

    boot = child_setup("front")
    keep_large_buffers()
    try:
        client = Client(boot["server_name"], socket_path_=boot["socket"],
                        arena_bytes=boot["arena_bytes"])
    except errors.ShmServeError as e:
        report_load(boot, {"ready": False, "error": e.msg})
        log.error("gRPC front %d: %s", boot["index"], e.msg)
        raise SystemExit(3)
    try:
        # uvloop, as the HTTP front: the loop's own steps in C; an answer's hand-over
        # from the engine's poller thread to the loop took 114 us on asyncio's loop, 62
        # on uvloop (4 KiB identity, bench/README.md "http_vs_triton.py")
        uvloop.run(serve(boot, client))
    finally:
        client.close()


if __name__ == "__main__":
    main()
