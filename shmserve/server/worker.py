"""Worker process: one per model instance. Loads one backend and executes the
batches the batcher puts in its mailbox, reading inputs from and writing outputs to
the callers' arenas.

    python -m shmserve.server.worker   (started by the coordinator; boot message on stdin)
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
import traceback

import numpy as np

from .. import _core
from ..backends import Instance, load_backend
from ..errors import ConfigError, ShmServeError
from ..logs import capture_model_output
from ..protocol import (LAYOUT, MAX_TENSORS, DataType, Duration, MailboxState, Status, Timestamp,
                        clip_error, decode_bytes, decode_parameters, encode_bytes, numpy_dtype)
from . import ragged, reshape, warmup
from .repository import ModelSpec
from .response_cache import ResponseCache
from .devices import CPU
from .maps import ServerMaps, child_setup
from .sequence_io import SequenceError, SequenceIO
from . import settings
from .stream import ResponseStream
from .tracing import Sampler

L = LAYOUT
BYTES = DataType.BYTES
_SHADOW_REQUEST = L["shadow.request"]
_N_OUTPUTS, _PARAMETERS_BYTES = L["request.n_outputs"], L["request.parameters_bytes"]
_N_INPUTS, _REF_BYTES, _KIND = L["request.n_inputs"], L["tensor_ref.size"], L["tensor_ref.memory_kind"]
_INPUTS, _OUTPUTS, _NBYTES = L["request.inputs"], L["request.outputs"], L["tensor_ref.nbytes"]
# A GPU worker's outputs from this size on go to the arena by one DMA (Python path):
# on the H200 machine a 4 MiB output staged by the C path took 0.8 ms to answer.
OUTPUT_STAGING_BYTES = 64 << 10
_NO_PARAMETERS: dict = {}  # never written: InferenceRequest.parameters() only reads it
STREAM = L["REQUEST_STREAM"]
log = logging.getLogger("shmserve.worker")


class BatchError(Exception):
    """Fails every request of the batch with `status`."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


class Request:
    """One request of a batch, as the batcher validated it (a server-private copy)."""

    __slots__ = ("client_id", "slot", "generation", "lease", "rows", "inputs", "outputs",
                 "taken_ns", "params_off", "params_bytes", "parameters", "arena", "slot_off",
                 "flags", "sequence_id", "sid_off", "sid_bytes", "sequence_slot", "corrid")

    def __init__(self, maps: ServerMaps, shadow_index: int):
        (self.client_id, self.slot, self.generation, self.lease, self.rows, self.inputs,
         self.outputs, self.taken_ns, self.params_off, self.params_bytes, self.flags,
         self.sequence_id, self.sid_off, self.sid_bytes, self.sequence_slot) = \
            maps.srv.read_shadow(maps.layout.shadow_at(shadow_index))
        self.parameters = {}  # decoded by decode_parameters() for models that read them
        self.arena = None
        self.slot_off = 0


class Worker:
    def __init__(self, boot: dict):
        self.maps = ServerMaps(boot)
        self.index = boot["worker_index"]
        self.model_id = boot["model_id"]
        self.spec = ModelSpec.from_dict(boot["model"])
        self.mailbox = self.maps.layout.mailbox(self.index)
        self.model_off = self.maps.layout.model(self.model_id)
        self.batched = self.spec.max_batch_size > 0
        self.reshaped_inputs = tuple(t for t in self.spec.inputs if t.reshape is not None)
        self.instance = Instance(boot.get("instance", 0), boot.get("server_name", "default"),
                                 boot.get("socket"), boot.get("device", CPU),
                                 boot.get("cuda_pool_bytes", 0))
        self.backend = None
        self.device = None  # gpu.ipc.DeviceMemory: callers' device tensors (use_device)
        self.stopping = False  # set by SIGTERM: leave serve_forever after the batch in hand
        # --trace-config: None when tracing is off, so run_batch does not even look
        self.tracer = Sampler(boot["trace"], self.model_id) if "trace" in boot else None
        self.trace_update = None  # changed trace settings, applied between batches
        self.per_request = False  # Triton's python API: execute_requests()
        # The common path's per-request work in C (_core.Batch, batch.c); BYTES tensors,
        # the per-request API and traces take the Python path (run_batch).
        self.batch = _core.Batch(self.maps.srv, self.model_off, self.mailbox)
        self.in_dtypes = [None if t.dtype == BYTES else numpy_dtype(t.dtype) for t in self.spec.inputs]
        self.out_dtypes = {t.name: None if t.dtype == BYTES else numpy_dtype(t.dtype)
                           for t in self.spec.outputs}
        self.fast = self.fast_requests = False  # set by load(): they depend on the backend
        # sequence_batching: control tensors and implicit state (sequence_io.py)
        self.sequences = SequenceIO(self.spec) if self.spec.sequence is not None else None
        # preserve_ordering: answers wait for the batches handed out before (maps.py);
        # the instances of a model have consecutive worker indexes.
        self.ordered = self.spec.preserve_ordering
        first = self.index - boot.get("instance", 0)
        self.siblings = [self.maps.layout.mailbox(w)
                         for w in range(first, first + self.spec.instance_count)]
        # response_cache with --cache-config: this instance's share (response_cache.py)
        cache_bytes = boot.get("cache_bytes", 0) if self.spec.response_cache else 0
        self.cache = ResponseCache(cache_bytes, self.spec.name, self.spec.version) if cache_bytes else None

    def set_fast_path(self) -> None:
        """Whether batches can take the C path (run_fast): nothing per request to do.
        Triton's API takes it too for a batch of one request that asks for every output
        and carries no parameters (run_mailbox looks): its inputs are views then."""
        common = (not (self.tracer and self.tracer.enabled) and self.sequences is None
                  and not self.spec.decoupled  # responses through each request's sender
                  and self.cache is None and not self.ragged and
                  all(t.dtype != BYTES for t in (*self.spec.inputs, *self.spec.outputs)))
        self.fast = common and not self.reads_parameters  # device refs: run_mailbox looks
        self.fast_requests = common and self.per_request

    def use_device(self) -> None:
        """A GPU instance of a library backend page-locks its callers' arenas; a
        pytorch one also reads and writes callers' device tensors (CUDA IPC)."""
        if self.instance.kind != "GPU" or self.spec.backend == "python":
            return
        from ..gpu import ipc
        try:
            self.maps.pinning = ipc.HostPinning()
        except Exception as e:
            log.warning("model '%s': callers' arenas stay pageable (%s)", self.spec.name, e)
        if self.spec.device_memory:
            self.device = ipc.DeviceMemory(self.backend.torch)
            self.backend.outputs_on_device = True

    def on_settings(self, settings: dict) -> None:
        """The settings watcher's (another thread): the trace settings are applied by
        serve_forever between batches."""
        self.trace_update = settings["trace"]

    def apply_trace_update(self) -> None:
        trace, self.trace_update = self.trace_update, None
        if self.tracer is not None:
            self.tracer.apply(trace)
            if self.backend is not None:
                self.set_fast_path()

    # -- 1. load --------------------------------------------------------------
    def load(self) -> None:
        self.backend = load_backend(self.spec, self.instance)
        self.use_device()
        self.per_request = getattr(self.backend, "per_request", False)
        if self.spec.decoupled and not self.per_request:
            raise ConfigError(f"model '{self.spec.name}': model_transaction_policy decoupled needs "
                              "a python model written with Triton's API (it sends its "
                              "responses through request.get_response_sender())")
        if self.spec.decoupled and self.sequences is not None:
            raise ConfigError(f"model '{self.spec.name}': sequence_batching with "
                              "model_transaction_policy decoupled is not implemented by "
                              "shmserve yet")
        # Models that read request parameters (Triton's API, or a numpy-dict execute with
        # a `requests` argument) take the Python path; the others never decode them.
        self.reads_parameters = self.per_request or getattr(self.backend, "wants_requests", False)
        # ragged.py: concatenated inputs, batch inputs, outputs scattered by input shape
        self.scattered_outputs = {t for _, targets, _ in self.spec.batch_outputs for t in targets}
        self.ragged = (any(t.ragged for t in self.spec.inputs) or bool(self.spec.batch_inputs)
                       or bool(self.spec.batch_outputs))
        if self.per_request and (self.spec.batch_inputs or self.spec.batch_outputs):
            raise ConfigError(f"model '{self.spec.name}': batch_input and batch_output need a "
                              "model that takes the whole batch; a python model written with "
                              "Triton's per-request API sees each request's own tensors")
        if self.cache is not None and self.per_request:
            log.warning("model '%s': response_cache is not applied to python models written "
                        "with Triton's per-request API yet; its requests always execute",
                        self.spec.name)
            self.cache = None
        self.output_names = tuple(t.name for t in self.spec.outputs)
        self.set_fast_path()
        warmup.run(self.spec, self.warm)  # Triton's model_warmup: before any request
        self.take_over_orphaned_batch()
        # SYNC POINT: the seq_cst store of our pid pairs with the batcher's load of
        # mailbox.pid in dispatch(): from then on it hands us batches; the doorbell
        # makes it look now (it may hold requests for this model already).
        self.maps.srv.store32(self.mailbox + L["mailbox.pid"], os.getpid())
        self.maps.ring_batcher()

    def take_over_orphaned_batch(self) -> None:
        """A predecessor that died mid-batch left its mailbox ASSIGNED. A model that
        declares retry_on_worker_crash has it run once more; otherwise, or if it
        already was (the batch may be what kills workers), its callers get an error now
        rather than never. A next batch waiting behind it never ran: it runs next, as
        it would have."""
        srv, mb = self.maps.srv, self.mailbox
        state = srv.load32(mb + L["mailbox.state"])
        if state == MailboxState.IDLE:
            return
        if state == MailboxState.PROMOTING:  # it died done, moving the next batch in place
            srv.mailbox_finish(mb)  # which we do again, and run as any batch
            return
        if self.spec.retry_on_worker_crash and srv.load32(mb + L["mailbox.attempt"]) == 0:
            srv.store32(mb + L["mailbox.attempt"], 1)
            log.warning("re-running the batch a dead worker held (retry_on_worker_crash)")
            self.run_mailbox(again=True)
            return
        again = " again" if self.spec.retry_on_worker_crash else ""
        self.maps.fail_batch(self.index, self.model_id,
                             f"model '{self.spec.name}': the worker executing this request "
                             f"died{again}; it was restarted")

    # -- 2. serve -------------------------------------------------------------
    def serve_forever(self) -> None:
        srv, state = self.maps.srv, self.mailbox + L["mailbox.state"]
        sleeping = self.mailbox + L["mailbox.worker_sleeping"]
        wakeups = self.mailbox + L["mailbox.wakeups"]
        waiting = self.mailbox + L["mailbox.batcher_waiting"]
        spin = self.maps.spin
        dropped_at = time.monotonic_ns()
        while not self.stopping:
            if self.trace_update is not None:
                self.apply_trace_update()
            # SYNC POINT: waits for the batcher's store of ASSIGNED (+ wake) in dispatch().
            started = time.monotonic_ns()
            if started - dropped_at >= 1_000_000_000:  # idle or not: dead clients' memory goes
                self.maps.drop_ended_leases()
                if self.device is not None:  # and what they had opened on the GPU
                    self.device.drop(self.maps.live_leases())
                dropped_at = started
            # the spin policy (shms_spin_wait) decides, and learns from this wait
            woke = srv.doorbell_wait(state, sleeping, MailboxState.IDLE, spin, 200_000_000)
            if not woke:
                if not self.maps.parent_alive():
                    return
                continue
            self.maps.count_wake(wakeups, woke)
            self.run_mailbox()
            # SYNC POINT: pairs with the batcher's store of batcher_waiting then re-check
            # of our state (seq_cst both): it is woken only when it has work waiting.
            if srv.load32(waiting):
                srv.store32(waiting, 0)
                self.maps.ring_batcher()

    def run_mailbox(self, again: bool = False) -> None:
        """Runs the batch in our mailbox, then marks it IDLE."""
        srv = self.maps.srv
        if self.fast and not again and not (self.device is not None and self.device_batch()):
            self.run_fast()
        elif self.fast_requests and not again and self.one_plain_request():
            self.run_fast()
        else:
            self.run_batch(srv.mailbox_batch(self.mailbox), again)
        if self.ordered:  # a batch that answered nobody (callers gone) ends its turn too
            ticket = srv.load64(self.mailbox + L["mailbox.ticket"]) & 0xFFFFFFFF
            if ticket:
                self.maps.end_answer_turn(self.model_id, ticket)
        # SYNC POINT (in shms_mailbox_finish): IDLE, or the next batch the batcher left
        # while we ran becomes ours (serve_forever runs it at once); pairs with the
        # batcher's loads of the state in dispatch() and its shms_mailbox_put.
        srv.mailbox_finish(self.mailbox)

    def one_plain_request(self) -> bool:
        """Whether the mailbox holds one request, asking for every output, without
        parameters: Triton's API runs it on the C path (run_fast)."""
        shadows = self.maps.srv.mailbox_batch(self.mailbox)
        if len(shadows) != 1:
            return False
        at = self.maps.layout.shadow_at(shadows[0]) + _SHADOW_REQUEST
        load = self.maps.srv.load32
        return (load(at + _N_OUTPUTS) == len(self.output_names)  # no output named twice
                and not load(at + _PARAMETERS_BYTES))

    def device_batch(self) -> bool:
        """Whether a GPU worker runs the mailbox's batch on the Python path: a request
        names device memory (opened there), or asks for outputs big enough that copying
        them from the device straight into its page-locked arena beats the C path's
        staging through pageable memory (OUTPUT_STAGING_BYTES)."""
        srv, load = self.maps.srv, self.maps.srv.load32
        for index in srv.mailbox_batch(self.mailbox):
            at = self.maps.layout.shadow_at(index) + _SHADOW_REQUEST
            for first, count in ((_INPUTS, load(at + _N_INPUTS)), (_OUTPUTS, load(at + _N_OUTPUTS))):
                for i in range(min(count, MAX_TENSORS)):
                    ref = at + first + i * _REF_BYTES
                    if load(ref + _KIND) & 0xFFFF:
                        return True
                    if first == _OUTPUTS and srv.load64(ref + _NBYTES) >= OUTPUT_STAGING_BYTES:
                        return True
        return False

    def run_fast(self) -> None:
        """The common path: the batch's bookkeeping in four kinds of C calls (begin,
        input/gather, scatter, finish), Python for the model call and its checks."""
        batch = self.batch
        missing = batch.begin(self.maps.mapped)
        if missing:  # a client's first request to this worker: map its arena, once
            for client_id, lease in missing:
                self.maps.arena(client_id, lease)
            batch.begin(self.maps.mapped, False, False)  # an arena still missing: gone
        if not len(batch):
            return
        t_input = time.monotonic_ns()
        if self.per_request:
            status, msg, outputs, t_infer, t_output = self.execute_one_request(batch)
        else:
            status, msg, outputs, t_infer, t_output = self.execute_timed(
                lambda: self.batch_inputs(batch), batch.rows)
        if outputs is not None:
            try:
                for k, spec in enumerate(self.spec.outputs):
                    out = outputs[spec.name]
                    if self.device is not None and self.device.is_tensor(out):
                        out = out.cpu().numpy()  # a GPU worker's output, for the C scatter
                    batch.scatter(k, np.ascontiguousarray(out))
            except Exception as e:  # cannot happen to checked outputs; answered, not lost
                status, msg = Status.INTERNAL, self.raised(e)
        ticket = self.answer_turn() if self.ordered else 0
        batch.finish(int(status), _clip(msg), t_input, t_infer, t_output)
        if ticket:
            self.maps.end_answer_turn(self.model_id, ticket)

    def execute_one_request(self, batch):
        """execute_requests for run_fast's one request (one_plain_request): its inputs
        view its caller's arena, every output is requested, no parameters. Returns as
        execute_timed does."""
        t_infer = t_output = outputs = None
        try:
            inputs = self.batch_inputs(batch)
            t_infer = time.monotonic_ns()
            (result,) = self.backend.execute_requests(
                [(inputs, self.output_names, _NO_PARAMETERS)])
            t_output = time.monotonic_ns()
            if type(result) is tuple:  # (status, message): the request's error
                status, msg = result
            else:
                outputs = self.check_outputs(result, batch.rows)
                status, msg = Status.OK, ""
        except BatchError as e:
            status, msg, outputs = e.status, str(e), None
        except Exception as e:  # the model raised: the request hears why
            status, msg, outputs = Status.INTERNAL, self.raised(e), None
        return (status, msg, outputs, t_infer or time.monotonic_ns(),
                t_output or time.monotonic_ns())

    def batch_inputs(self, batch) -> dict:
        """The inputs of the batch in hand (csrc/batch.c), in the model's shapes."""
        inputs = {}
        for k, spec in enumerate(self.spec.inputs):
            got = batch.input(k)
            if got is None:  # an optional input the batch left out stays out
                continue
            buf, offset, shape = got
            dt = self.in_dtypes[k]
            if buf is None:  # several requests: one copy each, into one array
                arr = np.empty(shape, dt)
                batch.gather(k, arr)
            else:  # one request: a view of its caller's arena
                arr = np.frombuffer(buf, dt, math.prod(shape), offset).reshape(shape)
            inputs[spec.name] = arr
        return self.to_model(inputs)

    def answer_turn(self) -> int:
        """preserve_ordering: waits for the batches handed out before ours to answer;
        returns our ticket (end_answer_turn after answering), 0 if the batch has none."""
        ticket = self.maps.srv.load64(self.mailbox + L["mailbox.ticket"]) & 0xFFFFFFFF
        if ticket:
            self.maps.wait_answer_turn(self.model_id, ticket, self.siblings, self.mailbox)
        return ticket

    def execute_timed(self, gather, rows: int, requests: list | None = None, keep=None):
        """One execution in Triton's compute stages: gather() the inputs, run the model,
        check its outputs. Returns (status, message, outputs or None, t_infer, t_output);
        a model that raises fails the whole batch, every caller hearing why. requests:
        per request (rows, parameters), for a numpy-dict model that takes them. keep:
        called with the model's outputs before they are checked (sequence states)."""
        t_infer = t_output = outputs = None
        try:
            inputs = gather()
            t_infer = time.monotonic_ns()
            outputs = (self.backend.execute(inputs) if requests is None
                       else self.backend.execute(inputs, requests))
            t_output = time.monotonic_ns()
            if keep is not None and isinstance(outputs, dict):
                keep(outputs)
            outputs = self.check_outputs(outputs, rows)
            status, msg = Status.OK, ""
        except (BatchError, SequenceError) as e:
            status, msg, outputs = e.status, str(e), None
        except ShmServeError as e:  # a request the model made failed (an ensemble's step)
            status, msg, outputs = e.code, e.msg, None
        except Exception as e:
            status, msg, outputs = Status.INTERNAL, self.raised(e), None
        return (status, msg, outputs, t_infer or time.monotonic_ns(),
                t_output or time.monotonic_ns())

    def run_batch(self, shadows: list[int], again: bool = False) -> None:
        live = []
        for index in shadows:
            req = Request(self.maps, index)
            mapped = self.maps.arena(req.client_id, req.lease)
            if mapped is None:  # the caller left: nothing to answer
                continue
            req.arena, layout = mapped
            req.slot_off = layout.slot(req.slot)
            if req.arena.ops.set_running(req.slot_off, req.generation, again):
                live.append(req)
        if not live:
            return
        live = self.decode_bytes_inputs(live)
        if self.reads_parameters:
            live = self.decode_parameters(live)
        if self.sequences is not None:
            live = self.begin_sequences(live)
        if self.device is not None:
            live = self.open_device_inputs(live)
        if not live:
            return
        # Triton's three compute stages: gather the inputs, run the model, check and
        # scatter the outputs (timed until the answers are written, before they go out).
        t_input = time.monotonic_ns()
        if self.spec.decoupled:  # responses sent through each request's sender
            self.run_decoupled(live, t_input)
            return
        executed = live
        if self.per_request:  # Triton's python API: a list of requests, a response each
            answers, t_infer, t_output = self.execute_requests(live)
        elif self.sequences is not None:
            answers, t_infer, t_output = self.execute_sequence_batch(live)
        elif self.cache is not None:  # hits are answered, not executed
            answers, t_infer, t_output, executed = self.execute_cached(live)
        else:
            answers, t_infer, t_output = self.execute_batch(live)
        if self.device is not None:  # device writes done before any caller hears
            self.device.synchronize()
        # Statistics first: a caller that reads them after its answer sees its request.
        srv, done = self.maps.srv, time.monotonic_ns()
        if executed:
            srv.record_execution(self.model_off, len(executed), sum(req.rows for req in executed),
                                 t_infer - t_input, t_output - t_infer, done - t_output)
        srv.record_answers(self.model_off, [(int(st), req.taken_ns)
                                            for req, (st, _, _) in zip(live, answers)])
        if executed:
            srv.add64(self.mailbox + L["mailbox.executions"], 1)
        traced = self.tracer.sample(live) if self.tracer is not None else None
        ticket = self.answer_turn() if self.ordered else 0
        for req, (st, m, results) in zip(live, answers):
            try:
                req.arena.ops.complete(req.slot_off, req.generation, int(st), _clip(m), results)
            except (IndexError, ValueError) as e:  # the caller unmapped or broke its arena
                log.warning("client %d: could not answer: %s", req.client_id, e)
        if ticket:
            self.maps.end_answer_turn(self.model_id, ticket)
        if traced:
            self.tracer.send(traced, t_input, t_infer, t_output, done)

    def execute_batch(self, live: list[Request]) -> tuple[list, int, int]:
        """The whole batch in one call (backend.execute: dicts of arrays), its outputs
        checked once and cut into each caller's rows. Returns (answers, t_infer, t_output)."""
        requests = ([(r.rows, r.parameters) for r in live] if self.reads_parameters else None)
        status, msg, outputs, t_infer, t_output = self.execute_timed(
            lambda: self.gather(live), sum(r.rows for r in live), requests)
        status, msg, parts = self.request_parts(status, msg, outputs, live)
        answers = []
        for req, part in zip(live, parts):
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            answers.append(self.scatter(req, part, 0) if status == Status.OK else (status, msg, []))
        return answers, t_infer, t_output

    def request_parts(self, status, msg, outputs, live: list[Request]):
        """(status, message, each request's outputs) of a batch's outputs: its rows, or
        for a batch_output, its part by its source input's shape (ragged.py)."""
        if status != Status.OK:
            return status, msg, [None] * len(live)
        try:
            return status, msg, ragged.split_outputs(
                outputs, self.spec.batch_outputs, self.request_shapes(live),
                [r.rows for r in live], self.batched)
        except ValueError as e:
            return Status.INTERNAL, f"model '{self.spec.name}': {e}", [None] * len(live)

    def request_shapes(self, live: list[Request]) -> list[dict]:
        """Per request, input name -> the shape it sent."""
        names = [t.name for t in self.spec.inputs]
        return [{names[ref[0]]: tuple(ref[4]) for ref in req.inputs} for req in live]

    def execute_cached(self, live: list[Request]) -> tuple[list, int, int, list[Request]]:
        """execute_batch with the response cache (response_cache.py): each request's
        inputs copied into this process, hashed, looked up; a hit is answered from the
        cache, the misses run as one batch (reading the copies that were hashed) and
        their outputs are kept. Returns (answers, t_infer, t_output, the requests run)."""
        cache, srv, model_off = self.cache, self.maps.srv, self.model_off
        answers: list = [None] * len(live)
        misses = []  # (index in live, inputs, key, lookup ns)
        for i, req in enumerate(live):
            t0 = time.monotonic_ns()
            buf = req.arena.buffer
            inputs = [(self.spec.inputs[ref[0]].name, np.array(self.view(buf, ref)))
                      for ref in req.inputs]
            key = cache.key(inputs, req.parameters if self.reads_parameters else None)
            kept = cache.get(key)
            if kept is None:
                misses.append((i, inputs, key, time.monotonic_ns() - t0))
                continue
            answers[i] = self.scatter(req, kept, 0)
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            srv.record_waits(model_off, Duration.CACHE_HIT, [t0])  # lookup and copy out
        if not misses:
            now = time.monotonic_ns()
            return answers, now, now, []
        run = [live[i] for i, *_ in misses]
        per_input = [[dict(inputs).get(spec.name) for _, inputs, _, _ in misses]
                     for spec in self.spec.inputs]
        requests = [(r.rows, r.parameters) for r in run] if self.reads_parameters else None
        status, msg, outputs, t_infer, t_output = self.execute_timed(
            lambda: self.merge_inputs(per_input, run), sum(r.rows for r in run), requests)
        status, msg, parts = self.request_parts(status, msg, outputs, run)
        for (i, _, key, lookup_ns), req, part in zip(misses, run, parts):
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            if status != Status.OK:
                answers[i] = (status, msg, [])
                continue
            answers[i] = self.scatter(req, part, 0)
            t0 = time.monotonic_ns() - lookup_ns  # the miss: its lookup and its insert
            cache.put(key, {name: np.array(arr) for name, arr in part.items()})
            srv.record_waits(model_off, Duration.CACHE_MISS, [t0])
        return answers, t_infer, t_output, run

    def begin_sequences(self, live: list[Request]) -> list[Request]:
        """Correlation ids and states of a sequence model's requests (sequence_io.py); a
        request that cannot run is answered here."""
        live, refused = self.sequences.begin(live)
        for req, status, msg in refused:
            self.maps.record_answers(self.model_id, [(int(status), req.taken_ns)])
            req.arena.ops.complete(req.slot_off, req.generation, int(status), _clip(msg), [])
        return live

    def execute_sequence_batch(self, live: list[Request]) -> tuple[list, int, int]:
        """A sequence model's batch as a dict of arrays: its rows (a direct batch by slot,
        null rows between), the control and state tensors added, the new states kept."""
        rows = self.sequences.rows(live)
        real = next(r for r in rows if r is not None)

        def gather():
            per_input = {}
            for k, spec in enumerate(self.spec.inputs):
                given = {ref[0]: ref for ref in real.inputs}
                if k not in given:
                    continue  # an optional input this batch leaves out
                arrays = []
                for r in rows:
                    if r is None:  # a null row: zeros shaped like a real one
                        arr = self.view(real.arena.buffer, given[k])
                        arrays.append(np.full_like(arr, b"") if arr.dtype == object else np.zeros_like(arr))
                    else:
                        arrays.append(self.view(r.arena.buffer, next(x for x in r.inputs if x[0] == k)))
                per_input[spec.name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            inputs = self.to_model(per_input)
            inputs.update(self.sequences.inputs(rows))
            return inputs

        requests = ([(1, r.parameters if r is not None else {}) for r in rows]
                    if self.reads_parameters else None)
        status, msg, outputs, t_infer, t_output = self.execute_timed(
            gather, len(rows), requests, lambda out: self.sequences.keep(rows, out))
        answers = []
        for i, req in enumerate(rows):
            if req is None:
                continue
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            answers.append(self.scatter(req, outputs, i) if status == Status.OK else (status, msg, []))
        return answers, t_infer, t_output

    def execute_requests(self, live: list[Request]) -> tuple[list, int, int]:
        """Triton's python API (backend.execute_requests, python_backend.py): the requests
        as a list, each with its inputs viewing its caller's arena (no gather), each
        answered alone (its outputs checked and written, or its own error). Returns
        (answers, t_infer, t_output)."""
        ins, outs = self.spec.inputs, self.spec.outputs
        requests = [([(ins[ref[0]].name, self.model_view(req.arena.buffer, ref))
                      for ref in req.inputs],
                     [outs[ref[0]].name for ref in req.outputs], req.parameters) for req in live]
        if self.sequences is not None:  # each request with its control and state tensors
            for req, (inputs, _, _) in zip(live, requests):
                inputs.extend(self.sequences.inputs([req]).items())
        t_infer = time.monotonic_ns()
        try:
            results = self.backend.execute_requests(requests)
        except Exception as e:  # the model raised: every request of the batch hears why
            results = [(Status.INTERNAL, self.raised(e))] * len(live)
        t_output = time.monotonic_ns()
        answers = []
        for req, (_, requested, _), result in zip(live, requests, results):
            req.arena.ops.stamp(req.slot_off, Timestamp.COMPUTE_END)
            if type(result) is tuple:  # (status, message): this request's error
                answers.append((*result, []))
                continue
            try:
                if self.sequences is not None:
                    self.sequences.keep([req], result)
                answers.append(self.scatter(req, self.check_outputs(result, req.rows, requested), 0))
            except (BatchError, SequenceError) as e:
                answers.append((e.status, str(e), []))
        return answers, t_infer, t_output

    def run_decoupled(self, live: list[Request], t_input: int) -> None:
        """A decoupled model's batch (server/stream.py): each STREAM request gets a
        ResponseStream its sender publishes through, from execute() or from any thread
        after it. The batch ends (the mailbox goes IDLE) once every request had its final
        response, so a worker that dies mid-stream leaves its batch ASSIGNED and its
        successor fails the requests still open (fail_batch), as for any batch."""
        streams = []
        for req in live:
            if req.flags & STREAM:
                streams.append(ResponseStream(self, req))
                continue
            self.maps.record_answers(self.model_id, [(int(Status.INVALID_ARG), req.taken_ns)])
            req.arena.ops.complete(req.slot_off, req.generation, int(Status.INVALID_ARG), _clip(
                f"model '{self.spec.name}' is decoupled (model_transaction_policy decoupled): it "
                "answers stream requests only (Client.infer_stream); as in Triton, the "
                "non-streaming inference API refuses decoupled models"), [])
        if not streams:
            return
        ins = self.spec.inputs
        requests = [[(ins[ref[0]].name, self.model_view(s.req.arena.buffer, ref))
                     for ref in s.req.inputs] for s in streams]
        t_infer = time.monotonic_ns()
        failed = None
        try:
            returned = self.backend.execute_decoupled(
                [(inputs, [self.spec.outputs[ref[0]].name for ref in s.req.outputs],
                  s.req.parameters, s) for inputs, s in zip(requests, streams)])
            if returned is not None:
                failed = (f"model '{self.spec.name}' is decoupled: execute() must return None "
                          "and send each request's responses through "
                          f"request.get_response_sender(); it returned {type(returned).__name__}")
        except Exception as e:  # the model raised: the requests still open hear why
            failed = self.raised(e)
        del requests
        t_output = time.monotonic_ns()
        if failed is not None:
            for s in streams:
                s.fail(Status.INTERNAL, failed)
        srv = self.maps.srv
        srv.record_execution(self.model_off, len(streams), sum(s.req.rows for s in streams),
                             t_infer - t_input, t_output - t_infer, time.monotonic_ns() - t_output)
        srv.add64(self.mailbox + L["mailbox.executions"], 1)
        for s in streams:  # responses may still come from the model's threads
            while not s.done.wait(0.2):
                if not self.maps.parent_alive():
                    return

    def raised(self, e: Exception) -> str:
        log.warning("model '%s' raised: %s", self.spec.name, traceback.format_exc(limit=3))
        return f"model '{self.spec.name}' raised {type(e).__name__}: {e}"

    # -- inputs: views of the callers' arenas, concatenated only for batches > 1 --
    def decode_parameters(self, live: list[Request]) -> list[Request]:
        """Decodes each request's parameters from its caller's arena. The batcher checked
        them, but the caller may have rewritten them since: a request whose bytes no longer
        decode fails alone, with the same message."""
        kept = []
        for req in live:
            if req.params_bytes:
                try:
                    req.parameters = decode_parameters(
                        req.arena.buffer[req.params_off:req.params_off + req.params_bytes])
                except ValueError as e:
                    self.maps.record_answers(self.model_id, [(int(Status.INVALID_ARG), req.taken_ns)])
                    req.arena.ops.complete(req.slot_off, req.generation, int(Status.INVALID_ARG),
                                           _clip(f"model '{self.spec.name}': {e}"), [])
                    continue
            kept.append(req)
        return kept

    def decode_bytes_inputs(self, live: list[Request]) -> list[Request]:
        """Parses BYTES inputs request by request: a malformed one fails only its own
        request. Parsed arrays replace the buffer references in req.inputs."""
        if not any(t.dtype == BYTES for t in self.spec.inputs):
            return live
        kept = []
        for req in live:
            buf, parsed = req.arena.buffer, []
            try:
                for ref in req.inputs:
                    index, dtype, offset, nbytes, shape = ref
                    if dtype == BYTES:
                        ref = (index, dtype, decode_bytes(buf[offset:offset + nbytes], shape), 0, shape)
                    parsed.append(ref)
            except (ValueError, MemoryError) as e:  # malformed: this request alone fails
                name = self.spec.inputs[index].name
                self.maps.record_answers(self.model_id, [(int(Status.INVALID_ARG), req.taken_ns)])
                req.arena.ops.complete(req.slot_off, req.generation, int(Status.INVALID_ARG),
                                       _clip(f"model '{self.spec.name}' input '{name}': {e}"), [])
                continue
            req.inputs = parsed
            kept.append(req)
        return kept

    def open_device_inputs(self, live: list[Request]) -> list[Request]:
        """Opens the inputs callers sent in device memory (CUDA IPC) request by request:
        a bad record fails only its own request. The tensors replace the references."""
        kept = []
        for req in live:
            try:
                req.inputs = [(ref[0], ref[1], self.device_view(req, ref, True), 0, ref[4])
                              if ref.memory_kind else ref for ref in req.inputs]
            except BatchError as e:
                self.maps.record_answers(self.model_id, [(int(e.status), req.taken_ns)])
                req.arena.ops.complete(req.slot_off, req.generation, int(e.status),
                                       _clip(str(e)), [])
                continue
            kept.append(req)
        return kept

    def view(self, buf, ref) -> np.ndarray:
        """One input of one request: a view of its caller's arena (BYTES: parsed;
        device memory: opened, a tensor)."""
        index, dtype, offset, nbytes, shape = ref
        if dtype == BYTES or offset.__class__ is not int:
            return offset  # parsed by decode_bytes_inputs, opened by open_device_inputs
        dt = numpy_dtype(dtype)
        return np.frombuffer(buf, dt, nbytes // dt.itemsize, offset).reshape(shape)

    def model_view(self, buf, ref) -> np.ndarray:
        """One request's input in the shape the model takes (config reshape)."""
        arr, spec = self.view(buf, ref), self.spec.inputs[ref[0]]
        return arr if spec.reshape is None else reshape.to_model(spec, arr, self.batched)

    def gather(self, live: list[Request]) -> dict:
        per_input: list[list] = [[] for _ in self.spec.inputs]
        for req in live:
            buf = req.arena.buffer
            for ref in req.inputs:
                per_input[ref[0]].append(self.view(buf, ref))
        return self.merge_inputs(per_input, live)

    def device_view(self, req: Request, ref, is_input: bool):
        """A tensor in the caller's device memory (gpu/ipc.py), as a torch tensor."""
        specs = self.spec.inputs if is_input else self.spec.outputs
        what = f"model '{self.spec.name}' {'input' if is_input else 'output'} '{specs[ref[0]].name}'"
        try:
            return self.device.tensor(req.arena.buffer, (req.client_id, req.lease), ref,
                                      numpy_dtype(ref[1]), ref[4], what, is_input)
        except ValueError as e:
            raise BatchError(Status.INVALID_ARG, str(e)) from None

    def merge_inputs(self, per_input: list[list], live: list[Request]) -> dict:
        """The batch's inputs from each input's per-request arrays, in the model's
        shapes; a ragged input as one flat concatenation, and the batch inputs."""
        out = {}
        for spec, arrays in zip(self.spec.inputs, per_input):
            # An optional input the batch left out stays out: requests batch only with
            # requests that give the same inputs (the shape key says which they give).
            if not arrays or arrays[0] is None:
                continue
            if spec.ragged:
                out[spec.name] = np.concatenate([a.reshape(-1) for a in arrays])
            else:
                out[spec.name] = (arrays[0] if len(arrays) == 1 else
                                  self.device.cat(arrays) if self.device is not None else
                                  np.concatenate(arrays))
        out = self.to_model(out)
        if self.spec.batch_inputs:
            out.update(ragged.batch_input_arrays(self.spec.batch_inputs, self.request_shapes(live)))
        return out

    def to_model(self, inputs: dict) -> dict:
        """Inputs as callers send them, in the shapes the model takes (config reshape)."""
        for spec in self.reshaped_inputs:
            if spec.name in inputs:
                inputs[spec.name] = reshape.to_model(spec, inputs[spec.name], self.batched)
        return inputs

    def warm(self, inputs: dict, rows: int) -> None:
        """One warmup execution (warmup.py): the path of a batch, outputs checked."""
        inputs = self.to_model(inputs)
        if self.sequences is not None:  # null rows: READY false, initial states
            inputs.update(self.sequences.inputs([None] * (1 if self.per_request else rows)))
        if self.per_request:  # Triton's python API: one request through execute(requests)
            (result,) = self.backend.execute_requests(
                [(list(inputs.items()), [t.name for t in self.spec.outputs], {})])
            if type(result) is tuple:  # (status, message): the request's error
                raise BatchError(*result)
            self.check_outputs(result, rows)
            return
        if getattr(self.backend, "wants_requests", False):  # one request, no parameters
            self.check_outputs(self.backend.execute(inputs, [(rows, {})]), rows)
            return
        self.check_outputs(self.backend.execute(inputs), rows)

    def check_outputs(self, outputs, rows: int, requested=None) -> dict:
        """The outputs checked against the config: every one (or every one requested)."""
        if not isinstance(outputs, dict):
            raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' returned "
                             f"{type(outputs).__name__}, expected a dict of arrays")
        checked = {}
        for spec in self.spec.outputs:
            if requested is not None and spec.name not in requested:
                continue
            if spec.name not in outputs:
                raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' did not produce "
                                 f"output '{spec.name}'")
            arr = outputs[spec.name]
            on_device = self.device is not None and self.device.is_tensor(arr)
            if not on_device:
                arr = np.asarray(arr)
            if spec.dtype == BYTES:
                if arr.dtype.kind not in "OSU":
                    raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' output "
                                     f"'{spec.name}' is {arr.dtype}, expected BYTES")
            else:
                want = self.out_dtypes[spec.name]
                if (self.device.numpy_dtype(arr) if on_device else arr.dtype) != want:
                    raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' output "
                                     f"'{spec.name}' is {arr.dtype}, config says {want}")
            if self.batched and (arr.ndim < 1 or arr.shape[0] != rows) and \
                    spec.name not in self.scattered_outputs:
                raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' output '{spec.name}' "
                                 f"has shape {arr.shape}, expected {rows} rows first")
            if spec.reshape is not None:  # the model's shape back into the config's dims
                try:
                    arr = reshape.to_caller(spec, arr, self.batched)
                except ValueError as e:
                    raise BatchError(Status.INTERNAL, f"model '{self.spec.name}' output "
                                     f"'{spec.name}' {e}") from None
            checked[spec.name] = arr
        return checked

    # -- outputs: one copy, from the model's array into the caller's arena --------
    def scatter(self, req: Request, outputs: dict, row: int):
        results = []
        too_small = []
        for ref in req.outputs:
            index, _, offset, capacity, _ = ref
            spec = self.spec.outputs[index]
            arr = outputs[spec.name]
            part = arr[row:row + req.rows] if self.batched else arr
            if ref.memory_kind:  # into the caller's device buffer (it was checked: kind 1)
                try:
                    result = self.scatter_to_device(req, ref, spec, part)
                except BatchError as e:  # this caller's record: its request alone fails
                    return e.status, str(e), []
                if result is None:  # answered in kind, as its output was given
                    too_small.append(spec.name)
                    result = _core.TensorRef((index, spec.dtype, offset, part.nbytes,
                                              tuple(part.shape), ref.memory_kind, ref.device_id))
                results.append(result)
                continue
            if spec.dtype == BYTES:
                data = encode_bytes(part)
                need = len(data)
            else:
                need = part.nbytes
            shape = part.shape
            if need > capacity:
                too_small.append(spec.name)
                results.append((index, spec.dtype, offset, need, shape))
                continue
            if spec.dtype == BYTES:
                req.arena.buffer[offset:offset + need] = data
            elif self.device is not None and self.device.is_tensor(part):  # D2H, pinned
                dst = np.frombuffer(req.arena.buffer, numpy_dtype(spec.dtype), need // _itemsize(spec), offset)
                self.device.to_host(dst.reshape(shape), part)
            else:
                dst = np.frombuffer(req.arena.buffer, part.dtype, part.size, offset)
                np.copyto(dst.reshape(shape), part)
            results.append((index, spec.dtype, offset, need, shape))
        if too_small:
            return (Status.OUTPUT_TOO_SMALL,
                    f"model '{self.spec.name}': output buffer too small for {', '.join(too_small)}",
                    results)
        return Status.OK, "", results


    def scatter_to_device(self, req: Request, ref, spec, part):
        """One output into the caller's device buffer (CUDA IPC): its result ref, or
        None when the buffer is too small."""
        dtype = numpy_dtype(spec.dtype)
        nbytes = int(np.prod(part.shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > ref.nbytes:
            return None
        dst = self.device_view(req, _core.TensorRef((ref.index, spec.dtype, ref.offset, ref.nbytes,
                                                     tuple(part.shape), ref.memory_kind,
                                                     ref.device_id)), False)
        dst.copy_(self.device.as_device(part))  # on the worker's stream; synchronized before answering
        return _core.TensorRef((ref.index, spec.dtype, ref.offset, nbytes, tuple(part.shape),
                          ref.memory_kind, ref.device_id))


def _itemsize(spec) -> int:
    return numpy_dtype(spec.dtype).itemsize


_clip = clip_error


def report_load(boot: dict, message: dict) -> None:
    """The one-line load report on the handshake pipe (none for a restarted worker:
    nobody waits for it). stdout is free for model code (its lines are logged)."""
    fd = boot.get("handshake_fd")
    if fd is not None:
        with os.fdopen(fd, "w") as pipe:
            pipe.write(json.dumps(message) + "\n")


def main() -> None:
    boot = child_setup("worker")
    model = boot["model"]
    capture_model_output(f"model '{model['name']}' version {model['version']} "
                         f"instance {boot['instance']}")
    worker = Worker(boot)
    settings.on_change(worker.on_settings)
    try:
        worker.load()
    except Exception as e:
        report_load(boot, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        sys.exit(3)
    log.debug("model '%s' version %d instance %d: loaded, taking batches", model["name"],
              model["version"], boot["instance"])
    report_load(boot, {"ready": True, "monotonic": time.monotonic()})
    # The coordinator's stop (SIGTERM) ends the loop after the batch in hand (its answers
    # and traces go out), then the model's finalize() runs, as Triton's unload does.
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "stopping", True))
    try:
        worker.serve_forever()
    finally:
        try:
            worker.backend.close()
        except Exception as e:  # a model failing in finalize() must not hide why, nor hang
            log.error("model '%s' version %d instance %d: finalize raised %s: %s", model["name"],
                      model["version"], boot["instance"], type(e).__name__, e)
            sys.exit(4)


if __name__ == "__main__":
    main()
