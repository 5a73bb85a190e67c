"""The HTTP/REST front (`shmserve serve --http-port`): KServe v2 / Open Inference
Protocol as Triton serves it, for callers that are not on this machine's shared memory
(tritonclient.http, load balancers, Kubernetes probes).

    python -m shmserve.front.http   (started by the coordinator; boot message on stdin)

A front is one process and one client lease of the engine: it decodes request bodies
straight into its arena (codec.py) and sends the views of the answers back. Several
fronts (--http-thread-count) each listen on the port with SO_REUSEPORT, so the kernel
spreads connections over them. HTTP parsing is uvicorn's with httptools, on uvloop
(chosen by bench/http_stacks.py; the app below is plain ASGI).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import signal
import socket
import zlib

from .. import __version__, errors
from .. import protocol as P
from ..client import Client
from ..server.statistics import triton_only
from . import classification, codec
from .common import CONTROL_TIMEOUT_S, EXTENSIONS, decoupled_refused, keep_large_buffers, \
    model_metadata, not_found_message, parse_version, server_ready

from .shm import SystemSharedMemory

log = logging.getLogger("shmserve.front")

# Triton's endpoints this front does not serve yet: answered 501, naming the extension.
NOT_YET = [
    (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?$"), "generate extension"),
]
TRACE_SETTING = re.compile(r"^/v2(?:/models/(?P<model>[^/]+)(?:/versions/[^/]+)?)?/trace/setting$")
MAX_SETTINGS_BYTES = 64 << 10  # a trace or log settings request's JSON
MODEL = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
                   r"(?P<what>/ready|/config|/stats|/infer)?$")
SHARED_MEMORY = re.compile(r"^/v2/(?P<kind>system|cuda)sharedmemory(?:/region/(?P<region>[^/]+))?"
                           r"/(?P<action>status|register|unregister)$")
MAX_REGISTER_BYTES = 64 << 10  # a register request's JSON
REPOSITORY = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)$")
LOAD_TIMEOUT_S = 600.0  # a load or unload waits for workers, or for a drain
MAX_HEADER_BYTES = 64 << 20  # the JSON part of a request (JSON tensors included)

_STATUS = {P.Status.INVALID_ARG: 400, P.Status.NOT_FOUND: 404, P.Status.UNAVAILABLE: 503,
           P.Status.BUSY: 503, P.Status.SERVER_DEAD: 503, P.Status.TIMEOUT: 503}


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Front:
    """The ASGI application: routes, then the engine's answer in Triton's shape."""

    def __init__(self, client: Client, max_in_flight: int, arena_bytes: int):
        self.client = client
        self.arena_bytes = arena_bytes  # no request's binary inputs can need more
        # submit() waits (blocking) for a free slot or arena space: never let this
        # process ask for more than its lease holds, so the loop is never blocked.
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.shm = SystemSharedMemory(client)  # the regions of every front (front/shm.py)
        self.labels = classification.Labels()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        try:
            status, body, headers = await self.route(scope, receive)
        except HttpError as e:
            status, body, headers = e.status, _error(e.message), {}
        except codec.BadRequest as e:
            status, body, headers = 400, _error(str(e)), {}
        except errors.ShmServeError as e:
            status, body, headers = _STATUS.get(e.code, 500), _error(e.msg), {}
        except Exception as e:  # a bug here: answered, logged, the front goes on
            log.exception("HTTP %s %s", scope["method"], scope["path"])
            status, body, headers = 500, _error(f"internal error: {type(e).__name__}: {e}"), {}
        await _send(send, status, body, headers)

    async def control(self, fn, *args, timeout: float = CONTROL_TIMEOUT_S):
        """A control-plane call of the engine, in a thread, bounded in time."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, fn, *args), timeout)
        except asyncio.TimeoutError:
            raise HttpError(503, f"the server did not answer within {timeout:g} s") from None

    async def repository(self, receive, path: str):
        """Triton's model repository extension: index, load (with
        parameters.config), unload. Errors as Triton's: {"error": ...}."""
        request = await _json_object(receive, MAX_HEADER_BYTES)  # model files in base64
        if path == "/v2/repository/index":
            ready = request.get("ready", False)
            if not isinstance(ready, bool):
                raise codec.BadRequest("'ready' must be a boolean")
            rows = await self.control(self.client.get_model_repository_index, ready)
            return 200, _json([{k: v for k, v in r.items() if v != ""} for r in rows]), {}
        m = REPOSITORY.match(path)
        if m is None:
            raise HttpError(404, f"no such endpoint: POST {path}")
        params = request.get("parameters", {})
        if not isinstance(params, dict):
            raise codec.BadRequest("'parameters' must be a JSON object")
        model = m["model"]
        if m["action"] == "unload":
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise codec.BadRequest("'unload_dependents' must be a boolean")
            await self.control(self.client.unload_model, model, dependents,
                               timeout=LOAD_TIMEOUT_S)
            return 200, b"", {}
        files = {}
        for key in (k for k in params if k.startswith("file:")):  # Triton: base64 contents
            try:
                files[key] = base64.b64decode(params[key], validate=True)
            except (TypeError, ValueError, binascii.Error):
                raise codec.BadRequest(f"parameters '{key}' must be the file's contents in "
                                       "base64") from None
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise codec.BadRequest("parameters 'config' must be a string holding the model "
                                   "configuration as JSON")
        await self.control(self.client.load_model, model, config, files or None,
                           timeout=LOAD_TIMEOUT_S)
        return 200, b"", {}

    async def settings(self, method: str, receive, path: str):
        """Triton's logging (/v2/logging) and trace (.../trace/setting) extensions:
        GET the settings, POST a JSON object of changes (server/settings.py checks
        them and applies them to every process)."""
        _method(method, "GET", "POST")
        update = (await _json_object(receive, MAX_SETTINGS_BYTES)) if method == "POST" else None
        if path == "/v2/logging":
            return 200, _json(await self.control(self.client.log_settings, update or None)), {}
        model = TRACE_SETTING.match(path)["model"]
        try:
            settings = await self.control(self.client.trace_settings, model, update or None)
        except errors.ModelNotFoundError:
            raise HttpError(404, not_found_message(model, None)) from None
        # Triton's HTTP answer: trace_level a list, every other setting one string
        return 200, _json({k: v if k == "trace_level" else v[0]
                           for k, v in settings.items()}), {}

    async def route(self, scope, receive):
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        if path == "/v2/health/live":
            _method(method, "GET")
            await self.control(self.client.models)  # the engine answers: live
            return 200, b"", {}
        if path == "/v2/health/ready":
            _method(method, "GET")
            models = await self.control(self.client.models)
            return (200 if server_ready(models) else 400), b"", {}
        if path == "/v2":
            _method(method, "GET")
            return 200, _json({"name": "shmserve", "version": __version__,
                               "extensions": EXTENSIONS}), {}
        if path == "/v2/models/stats":
            _method(method, "GET")
            return 200, await self.stats(None, None), {}
        if path.startswith("/v2/repository/"):
            _method(method, "POST")
            return await self.repository(receive, path)
        m = SHARED_MEMORY.match(path)
        if m is not None:
            _method(method, "GET" if m["action"] == "status" else "POST")
            if m["kind"] == "cuda":
                return _cuda_shared_memory(m["region"], m["action"])
            return await self.system_shared_memory(receive, m["region"], m["action"])
        if path == "/v2/logging" or TRACE_SETTING.match(path):
            return await self.settings(method, receive, path)
        for pattern, extension in NOT_YET:
            if pattern.match(path):
                raise HttpError(501, f"the {extension} is not supported by shmserve's HTTP "
                                     f"front yet ({method} {path})")
        m = MODEL.match(path)
        if m is None:
            raise HttpError(404, f"no such endpoint: {method} {path}")
        model, what = m["model"], m["what"]
        try:
            version = parse_version(model, m["version"])
        except ValueError as e:
            raise HttpError(400, str(e)) from None
        if what == "/infer":
            _method(method, "POST")
            return await self.infer(scope, receive, model, version)
        _method(method, "GET")
        if what == "/stats":
            return 200, await self.stats(model, version), {}
        try:
            if what == "/ready":
                try:
                    meta = await self.control(self.client.model_metadata, model, version)
                except errors.UnavailableError:  # unloaded or broken: not ready, as Triton
                    return 400, b"", {}
                return (200 if meta["state"] == "READY" else 400), b"", {}
            if what == "/config":
                from ..pb_utils.config import config_dict
                from ..server.repository import parse_config

                text = await self.control(self.client.model_config, model, version)
                return 200, _json(config_dict(parse_config(text, f"model '{model}'"))), {}
            return 200, _json(await self.metadata(model, version)), {}
        except errors.ModelNotFoundError:
            raise HttpError(404, not_found_message(model, version)) from None

    async def system_shared_memory(self, receive, region, action: str):
        """Triton's system shared memory extension: status, register, unregister."""
        if action == "status":
            return 200, _json(await self.control(self.shm.status, region)), {}
        if action == "unregister":
            await self.control(self.shm.unregister, region)
            return 200, b"", {}
        if region is None:
            raise HttpError(400, "'region name' is necessary to register system shared "
                                 "memory region")
        body = bytearray()
        async for chunk in _body(receive):
            body += chunk
            if len(body) > MAX_REGISTER_BYTES:
                raise HttpError(413, f"a register request's JSON is larger than "
                                     f"{MAX_REGISTER_BYTES} bytes")
        request = codec.parse_header(bytes(body))
        for field in ("key", "byte_size"):
            if field not in request:
                raise HttpError(400, f"Shared memory register request has no '{field}' field")
        key, offset, size = request["key"], request.get("offset", 0), request["byte_size"]
        if not isinstance(key, str):
            raise HttpError(400, "Unable to parse 'key': expected a string")
        for field, value in (("offset", offset), ("byte_size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise HttpError(400, f"Unable to parse '{field}': expected a non-negative "
                                     f"integer, got {value!r}")
        await self.control(self.shm.register, region, key, offset, size)
        return 200, b"", {}

    async def metadata(self, model: str, version) -> dict:
        meta = await self.control(self.client.model_metadata, model, version)
        models = None if version is not None else await self.control(self.client.models)
        return model_metadata(meta, models)

    async def stats(self, model, version) -> bytes:
        try:
            stats = await self.control(self.client.statistics, model, version)
        except errors.ModelNotFoundError:
            raise HttpError(404, not_found_message(model, version)) from None
        return _json({"model_stats": [triton_only(s) for s in stats]})

    async def infer(self, scope, receive, model: str, version):
        headers = dict(scope["headers"])
        header_len = headers.get(b"inference-header-content-length")
        if header_len is not None:
            try:
                header_len = int(header_len)
                if header_len < 0:
                    raise ValueError
            except ValueError:
                raise codec.BadRequest("Inference-Header-Content-Length must be a non-negative "
                                       f"integer, got {header_len.decode(errors='replace')!r}") from None
        encoding = headers.get(b"content-encoding", b"identity").decode(errors="replace").lower()
        chunks = _body(receive)
        if encoding in ("gzip", "deflate"):
            chunks = _inflate(chunks, encoding)
        elif encoding != "identity":
            raise HttpError(415, f"unsupported Content-Encoding '{encoding}' (gzip, deflate)")
        # The JSON header first: it says where the binary inputs go.
        head = bytearray()
        rest = b""
        async for chunk in chunks:
            if header_len is not None and len(head) + len(chunk) >= header_len:
                cut = header_len - len(head)  # the binary data after it is not copied here
                head += memoryview(chunk)[:cut]
                rest = memoryview(chunk)[cut:]
                break
            head += chunk
            if len(head) > MAX_HEADER_BYTES:
                raise HttpError(413, f"the request's JSON is larger than {MAX_HEADER_BYTES} bytes")
        if header_len is not None and len(head) < header_len:
            raise codec.BadRequest(f"unexpected end of request: Inference-Header-Content-Length "
                                   f"is {header_len}, the body has {len(head)} bytes")
        header = codec.parse_header(bytes(head))
        length = headers.get(b"content-length")
        binary_bytes = None
        if header_len is not None and length is not None and encoding == "identity":
            binary_bytes = int(length) - header_len  # httptools checked it is a number
        try:
            inputs = codec.plan_inputs(header, self.client.empty, binary_bytes,
                                       self.arena_bytes)
        except errors.ShmServeError as e:
            raise HttpError(_STATUS.get(e.code, 500), e.msg) from None
        filler = codec.BinaryFiller(inputs)
        if filler.targets and header_len is None:
            raise codec.BadRequest("binary_data_size given without an "
                                   "Inference-Header-Content-Length header")
        if rest:
            filler.feed(rest)
        async for chunk in chunks:
            filler.feed(chunk)
        filler.close()
        names, binary = codec.wanted_outputs(header)
        counts = codec.class_counts((o["name"], o.get("parameters") or {})
                                    for o in header.get("outputs") or [])
        options = codec.request_options(header)
        shm_out = codec.shm_outputs(header)
        shm_in = [t for t in inputs if t.shm is not None]
        targets = {}
        if shm_in or shm_out:
            if self.shm.needs_refresh():
                await self.control(self.shm.refresh)
            for t in shm_in:
                t.value = self.shm.read_input(*t.shm, name=t.name, datatype=t.datatype,
                                              dtype=t.dtype, shape=t.shape, model=model,
                                              empty=self.client.empty)
            targets = {name: self.shm.output_target(*spec) for name, spec in shm_out.items()}
        arrays = {t.name: t.finish() for t in inputs}
        try:
            plan = self.client.engine.plan(model, version)
        except errors.ModelNotFoundError:
            raise HttpError(404, not_found_message(model, version)) from None
        if plan.meta["decoupled"]:  # as Triton: 501
            raise HttpError(501, decoupled_refused("HTTP end point", model))
        async with self.in_flight:
            try:
                result = await self.client.infer_async(model, arrays, names, version, **options)
            except errors.ModelNotFoundError:
                raise HttpError(404, not_found_message(model, version)) from None
        meta = self.client.engine.plan(model, version).meta
        datatypes = {t["name"]: t["datatype"] for t in meta["outputs"]}
        if counts:
            result = await classification.classified(
                result, counts, meta, datatypes, self.labels.of(meta, self.control, self.client))
        in_shm = {name: (shm_out[name][0],
                         self.shm.write_output(target, name, result[name], datatypes[name]))
                  for name, target in targets.items() if name in result}
        parts, json_len = codec.encode_response(result, datatypes, binary, header.get("id"),
                                                in_shm)
        if json_len is None:
            return 200, parts[0], {}
        return 200, parts, {b"content-type": b"application/octet-stream",
                            b"inference-header-content-length": str(json_len).encode()}


async def _body(receive):
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(400, "the client closed the connection before the request's end")
        body = message.get("body", b"")
        if body:
            yield body
        if not message.get("more_body", False):
            return


async def _inflate(chunks, encoding: str):
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        async for chunk in chunks:
            out = inflater.decompress(chunk)
            if out:
                yield out
        tail = inflater.flush()
    except zlib.error as e:
        raise codec.BadRequest(f"the body is not valid {encoding} data: {e}") from None
    if tail:
        yield tail


def _cuda_shared_memory(region, action: str):
    """CUDA shared memory needs a GPU build: a registration is refused by name; status
    lists nothing and unregistering succeeds, as Triton without GPUs answers (tools such
    as perf_analyzer unregister both kinds of region before they start)."""
    if action == "register" and region is None:
        raise HttpError(400, "'region name' is necessary to register cuda shared memory region")
    if action == "register":
        raise HttpError(400, f"failed to register CUDA shared memory region: '{region}', GPUs "
                             "not supported: CUDA shared memory needs a GPU build of shmserve "
                             "(this one serves system shared memory only)")
    if action == "status" and region is not None:
        raise HttpError(404, f"Unable to find cuda shared memory region: '{region}'")
    return 200, (_json([]) if action == "status" else b""), {}


def _method(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise HttpError(405, f"method {method} is not allowed here (use {' or '.join(allowed)})")


async def _json_object(receive, limit: int) -> dict:
    """A request body as a JSON object (empty: {}), at most `limit` bytes."""
    body = bytearray()
    async for chunk in _body(receive):
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"the request's JSON is larger than {limit} bytes")
    try:
        request = json.loads(body) if body.strip() else {}
    except ValueError as e:
        raise codec.BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(request, dict):
        raise codec.BadRequest("the request body must be a JSON object")
    return request


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _error(message: str) -> bytes:
    return _json({"error": message})


async def _send(send, status: int, body, headers: dict) -> None:
    parts = body if isinstance(body, list) else [body]
    if len(parts) > 1 and sum(len(p) for p in parts) <= 1 << 16:
        parts = [b"".join(parts)]  # one write for a small answer; big ones go as views
    head = {b"content-type": b"application/json", **headers,
            b"content-length": str(sum(len(p) for p in parts)).encode()}
    await send({"type": "http.response.start", "status": status, "headers": list(head.items())})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


def listen(address: str, port: int) -> socket.socket:
    """The front's listening socket: SO_REUSEPORT, so that every front binds the port
    and the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((address, port))
    sock.listen(2048)
    return sock


def main() -> None:
    import uvicorn
    import uvloop

    from ..server.maps import child_setup
    from ..server.worker import report_load

    boot = child_setup("front")
    keep_large_buffers()
    try:
        client = Client(boot["server_name"], socket_path_=boot["socket"],
                        arena_bytes=boot["arena_bytes"])
        sock = listen(boot["address"], boot["port"])
    except (errors.ShmServeError, OSError) as e:
        why = e.msg if isinstance(e, errors.ShmServeError) else \
            f"http {boot['address']}:{boot['port']}: {e.strerror or e}"
        report_load(boot, {"ready": False, "error": why})
        log.error("HTTP front %d: %s", boot["index"], why)
        raise SystemExit(3)
    config = uvicorn.Config(Front(client, boot["slots_per_client"], boot["arena_bytes"]), http="httptools",
                            lifespan="off", log_config=None, access_log=False,
                            server_header=False, timeout_graceful_shutdown=2,
                            proxy_headers=False)  # its middleware's work per request, unused
    server = uvicorn.Server(config)

    async def serve():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        report_load(boot, {"ready": server.started})
        await task

    # uvicorn stops on SIGTERM/SIGINT, then raises the signal again under the handler
    # found before it: a no-op here, so that a stopped front closes its lease, exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvloop.run(serve())
    finally:
        # The coordinator's shutdown may send a second SIGTERM while this process
        # exits, when Python would put the default handlers back: ignored, in one step
        # (a mask would cover this thread only, not the engine's poller thread).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        client.close()


if __name__ == "__main__":
    main()
