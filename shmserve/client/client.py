"""The Python client: the facade callers use over the client engine (engine.py).

    with shmserve.Client() as c:
        out = c.infer("simple", {"INPUT0": a, "INPUT1": b})
        print(out["OUTPUT0"])          # a view of shared memory, valid while `out` lives

Three ways to wait, one engine: infer() (blocking), submit() (a Future) and
infer_async() (asyncio). A decoupled model (0..n responses per request) is called with
infer_stream() (an iterator of responses) or infer_stream_async() (an async one):

    for response in c.infer_stream("repeat", {"IN": a}):
        print(response.index, response["OUT"], response.final)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import numpy as np

from .. import errors
from .. import protocol as P
from ..segments import DEFAULT_NAME
from .engine import MAX_SPIN_US, SPIN_US, Engine
from .request import version_key
from .result import InferResult, StreamResponse
from .stream import AsyncResponseStream, ResponseStream

__all__ = ["Client", "InferResult", "StreamResponse", "ResponseStream", "SPIN_US", "MAX_SPIN_US"]


def _options(priority, timeout_us, parameters, sequence_id=0, sequence_start=False,
             sequence_end=False):
    """The engine's options tuple (None when all are defaults: the common case)."""
    if not (priority or timeout_us or parameters or sequence_id or sequence_start or sequence_end):
        return None
    try:
        return P.options(priority, timeout_us, parameters, sequence_id, sequence_start, sequence_end)
    except (ValueError, TypeError) as e:
        raise errors.InvalidArgumentError(str(e)) from None


class Client:
    """A lease on a running server. Thread-safe; one per process is enough.

    name:        the server's instance name (`shmserve serve --name`), default "default"
    arena_bytes: size of this client's shared arena (inputs and outputs in flight)
    spin_us:     how long a waiting call spins at least before it sleeps (default
                 SPIN_US; adapts up to MAX_SPIN_US to the answer times it sees; 0 = never)
    """

    def __init__(self, name: str = DEFAULT_NAME, *, socket_path_: str | None = None,
                 arena_bytes: int | None = None, spin_us: int | None = None):
        self.engine = Engine(name, socket_path_=socket_path_, arena_bytes=arena_bytes,
                             spin_us=spin_us)
        self.name = name
        self.client_id = self.engine.client_id
        self.server_pid = self.engine.server_pid

    # -- control plane ------------------------------------------------------------
    def models(self) -> list[dict]:
        """Every loaded (model, version) with its state."""
        return self.engine.call(P.ListModels()).models

    def model_metadata(self, model: str, version: int | None = None) -> dict:
        return dataclasses.asdict(self.engine.call(P.GetMetadata(model, version_key(version))))

    def model_config(self, model: str, version: int | None = None) -> str:
        """config.pbtxt as the server parsed it (protobuf text format)."""
        return self.engine.call(P.GetConfig(model, version_key(version))).config

    def labels(self, model: str, version: int | None = None) -> P.LabelsReply:
        """The labels of the model version's outputs that name a label_filename, and
        the version's handle (which a reload changes)."""
        return self.engine.call(P.GetLabels(model, version_key(version)))

    def log_settings(self, update: dict | None = None) -> dict:
        """Triton's logging extension: the server's log settings (Triton's names), after
        applying `update` ({setting: value}) to every process of the server."""
        return self.engine.call(P.LogSettings(update)).settings

    def trace_settings(self, model: str | None = None, update: dict | None = None) -> dict:
        """Triton's trace extension: the trace settings (each a list of strings), after
        applying `update` ({setting: value or list of values; None: back to the value
        at start}). Per-model settings are not served: `model` is only checked."""
        return self.engine.call(P.TraceSettings(model, update)).settings

    def statistics(self, model: str | None = None, version: int | None = None,
                   histograms: bool = False) -> list[dict]:
        """Triton's statistics extension, one model_stat per model version (all, every
        version of `model`, or one), each with shmserve's own figures under "shmserve"
        (state, pending, failures by reason, batches by requests, instances; with
        histograms, each duration's latency histogram). See docs/operating.md."""
        return self.engine.call(P.GetStats(model, version_key(version), histograms)).model_stats

    def server_status(self) -> dict:
        """The server at a glance, as `shmserve status` shows it: "models" (statistics
        with histograms), "clients", "ring_depth", "batcher", "uptime_s"."""
        return self.engine.call(P.GetStatus()).status

    # -- model control (Triton's repository extension; --model-control-mode explicit)
    def load_model(self, model: str, config: str | dict | None = None,
                   files: dict[str, bytes] | None = None) -> None:
        """Loads a model of the server's repository, or reloads it (new version
        directories, an edited config.pbtxt) without losing a request. config: the
        model configuration (JSON text or a dict), used instead of config.pbtxt.
        files: as tritonclient's, {"file:1/model.onnx": bytes, ...}: the model is made
        of these files and config (which they need), not read from the repository;
        all of it travels in one control frame (16 MiB at most).
        Raises InvalidArgumentError naming each version that failed to load (the
        version it would replace keeps serving)."""
        if isinstance(config, dict):
            config = json.dumps(config)
        if files is not None:
            bad = [k for k in files if not (isinstance(k, str) and k.startswith("file:"))]
            if bad:
                raise ValueError(f"load_model files: keys are 'file:<path>', not {bad[0]!r}")
            files = {k[len("file:"):]: bytes(v) for k, v in files.items()}
        try:
            self.engine.call(P.LoadModel(model, config, files))
        finally:
            self.engine.forget(model)

    def unload_model(self, model: str, unload_dependents: bool = False) -> None:
        """Unloads every version of a model: its requests in flight finish, new ones
        are refused (UNAVAILABLE, naming the model); returns once its workers stopped.
        unload_dependents: the ensembles that call it go too (Triton's); else they
        stay loaded and their requests fail naming the missing step."""
        try:
            self.engine.call(P.UnloadModel(model, unload_dependents))
        finally:
            self.engine.forget(model)

    def get_model_repository_index(self, ready: bool = False) -> list[dict]:
        """Triton's repository index: [{name, version, state, reason}] for every model
        of the repository (version and state "" for one never loaded); ready=True:
        only the READY versions."""
        return self.engine.call(P.RepositoryIndex(ready)).models

    # -- arena ------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """An array that lives in this client's shared arena: pass it to infer() and
        no input byte is copied. Its memory returns to the arena when it is freed."""
        return self.engine.empty(shape, dtype)

    # -- requests -------------------------------------------------------------------------
    def infer(self, model: str, inputs, outputs=None, version: int | None = None,
              timeout: float | None = None, copy: bool = False, *, priority: int = 0,
              timeout_us: int = 0, parameters=None, sequence_id: int | str = 0,
              sequence_start: bool = False, sequence_end: bool = False) -> InferResult:
        """Runs one request and waits for it. inputs: {name: array} (or a list in the
        model's input order); outputs: names to return (default: all). With copy=True
        the outputs are private copies and the arena is released at once. `timeout`
        (seconds) is how long this caller waits.

        Request options, as Triton's: priority (1 = highest; 0 = the model's
        default_priority_level), timeout_us (the server's queue timeout for this request,
        honoured where the model's queue policy has allow_timeout_override; 0 = the
        model's), parameters ({name: bool | int | float | str}, Triton's request
        parameters, given to the model); for a model with sequence_batching,
        sequence_id (Triton's correlation id: a non-zero integer or a non-empty string),
        sequence_start and sequence_end (the first and last request of the sequence)."""
        if priority or timeout_us or parameters or sequence_id or sequence_start or sequence_end:
            return self.engine.infer(model, inputs, outputs, version, timeout, copy,
                                     _options(priority, timeout_us, parameters, sequence_id,
                                              sequence_start, sequence_end))
        return self.engine.infer(model, inputs, outputs, version, timeout, copy)

    def submit(self, model: str, inputs, outputs=None, version: int | None = None,
               copy: bool = False, *, priority: int = 0, timeout_us: int = 0,
               parameters=None, sequence_id: int | str = 0, sequence_start: bool = False,
               sequence_end: bool = False) -> concurrent.futures.Future:
        """Sends a request and returns at once; the Future resolves to an InferResult.
        Many requests may be in flight from one caller (up to the slots of the lease).
        Request options as infer()'s. The requests of one sequence submitted without
        waiting run in the order submitted. The inputs' dict or list may be reused once
        this returns. future.cancel() stops waiting for the answer (CancelledError); the
        server still runs the request, and its memory comes back with its answer."""
        if priority or timeout_us or parameters or sequence_id or sequence_start or sequence_end:
            return self.engine.submit(model, inputs, outputs, version, copy,
                                      _options(priority, timeout_us, parameters, sequence_id,
                                               sequence_start, sequence_end))
        return self.engine.submit(model, inputs, outputs, version, copy)

    async def infer_async(self, model: str, inputs, outputs=None, version: int | None = None,
                          copy: bool = False, *, priority: int = 0, timeout_us: int = 0,
                          parameters=None, sequence_id: int | str = 0, sequence_start: bool = False,
                          sequence_end: bool = False) -> InferResult:
        """asyncio form of infer()."""
        return await asyncio.wrap_future(self.submit(
            model, inputs, outputs, version, copy, priority=priority, timeout_us=timeout_us,
            parameters=parameters, sequence_id=sequence_id, sequence_start=sequence_start,
            sequence_end=sequence_end))

    def infer_stream(self, model: str, inputs, outputs=None, version: int | None = None,
                     timeout: float | None = None, *, output_bytes: int = 0, priority: int = 0,
                     timeout_us: int = 0, parameters=None, sequence_id: int | str = 0,
                     sequence_start: bool = False, sequence_end: bool = False) -> ResponseStream:
        """Sends one request and returns an iterator of its responses (StreamResponse:
        outputs by name, copied; .index; .final; .error for an error response the model
        sent). A decoupled model (model_transaction_policy decoupled) sends 0..n
        responses; any other model one. The iteration ends after the final response;
        an error of the request itself (refused, the model raised, its worker died)
        is raised. Closing the iterator early (close(), cancel(), a `with` block, or
        dropping it) cancels the request: the model's is_cancelled() turns True.
        timeout (seconds): the longest wait for each response. output_bytes: the size of
        each output buffer whose shape the config leaves open (default: as infer's
        guess, the inputs' size; a response that does not fit is an OUTPUT_TOO_SMALL
        error response). Request options as infer()'s."""
        return self.engine.stream(model, inputs, outputs, version, timeout,
                                  _options(priority, timeout_us, parameters, sequence_id,
                                           sequence_start, sequence_end), output_bytes)

    def infer_stream_async(self, model: str, inputs, outputs=None, version: int | None = None,
                           timeout: float | None = None, **kwargs) -> AsyncResponseStream:
        """infer_stream() as an async iterator: `async for response in
        client.infer_stream_async(...)`. Keyword options as infer_stream()'s."""
        return AsyncResponseStream(self.infer_stream(model, inputs, outputs, version, timeout,
                                                     **kwargs))

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the lease: the server reclaims the arena. Output arrays still referenced
        keep their mapping alive until they are freed."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
