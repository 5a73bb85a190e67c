"""What a sequence model's worker adds to each execution (config `sequence_batching`,
sequence_config.py): the control tensors as Triton feeds them, and the implicit state.

The batcher (scheduling/sequence.py) sends every request of a sequence to one instance,
in order, one per batch, and writes the sequence's batch slot into the request's
server-private copy (shms_shadow.sequence_slot, slot + 1). This worker keeps each
slot's state: at a START it is the initial state (zeros, or initial_state's
data_file), then whatever the model last returned as the state output. A slot is
taken by a new sequence only with a START, so a released sequence's state is simply
replaced; a worker that restarted has lost its states, and a request of a sequence
begun before is answered UNAVAILABLE.

Control tensors: START, END, READY hold the config's false/true values (int32, fp32 or
bool), CORRID the correlation id in its data_type (TYPE_STRING: the string id); shape
[rows, 1] for a batching model ([1] without). A direct batch of a numpy-dict model is
indexed by slot: a slot with no request is a null row (READY false, zeros in every
input, its outputs dropped), as Triton's direct strategy gives it; Triton's python
API gets the batch's requests alone, each with its own [1, 1] control tensors.
"""
from __future__ import annotations

import numpy as np

from ..protocol import SEQUENCE_END, SEQUENCE_START, DataType, Status, decode_sequence_id, numpy_dtype
from .repository import ModelSpec

BYTES = DataType.BYTES


class SequenceError(Exception):
    """One request cannot run: answered with this status and message."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


class SequenceIO:
    def __init__(self, spec: ModelSpec):
        seq = spec.sequence
        self.name = spec.name
        self.batched = spec.max_batch_size > 0
        self.direct = seq["strategy"] == "direct"
        # (kind, name, numpy dtype, false value, true value)
        self.controls = [(kind, name, numpy_dtype(dtype), f, t)
                         for kind, name, dtype, f, t in seq["controls"]]
        self.corrid = seq["corrid"]  # [name, dtype code] or None
        self.initial = {}  # state input name -> initial array (without batch dimension)
        self.outputs = {}  # state input name -> state output name
        for input_name, output_name, dtype, dims, data_file in seq["states"]:
            dt = numpy_dtype(dtype)
            self.initial[input_name] = (np.fromfile(data_file, dt).reshape(dims) if data_file
                                        else np.zeros(dims, dt))
            self.outputs[input_name] = output_name
        self.slots: dict[int, tuple[object, dict]] = {}  # slot + 1 -> (corrid, {input: state})

    def corrid_of(self, req) -> object:
        if req.sid_bytes:  # the caller's bytes again (the batcher checked them)
            return decode_sequence_id(req.arena.buffer[req.sid_off:req.sid_off + req.sid_bytes])
        return req.sequence_id

    def begin(self, live: list) -> tuple[list, list]:
        """Each request's correlation id, and its slot's state at START. Returns (the
        requests that can run, [(request, status, message)] that cannot)."""
        kept, refused = [], []
        for req in live:
            try:
                req.corrid = self.corrid_of(req)
            except ValueError as e:
                refused.append((req, Status.INVALID_ARG, f"model '{self.name}': {e}"))
                continue
            if not self.initial:
                kept.append(req)
                continue
            if req.flags & SEQUENCE_START:
                self.slots[req.sequence_slot] = (req.corrid, dict(self.initial))
            held = self.slots.get(req.sequence_slot)
            if held is None or held[0] != req.corrid:
                refused.append((req, Status.UNAVAILABLE, f"model '{self.name}': the state of "
                                f"sequence {req.corrid!r} was lost (its instance restarted); "
                                "start the sequence again"))
                continue
            kept.append(req)
        return kept, refused

    def rows(self, live: list) -> list:
        """The batch's rows: a direct batch by slot (None: a null row), else as given."""
        if not self.direct or not self.batched:
            return live
        rows = [None] * max(req.sequence_slot for req in live)
        for req in live:
            rows[req.sequence_slot - 1] = req
        return rows

    def control_values(self, req) -> dict:
        """One row's control values (req None: a null row)."""
        flags = req.flags if req is not None else 0
        on = {"START": flags & SEQUENCE_START, "END": flags & SEQUENCE_END, "READY": req is not None}
        return {name: (t if on[kind] else f) for kind, name, _, f, t in self.controls}

    def inputs(self, rows: list) -> dict:
        """The control and state tensors of a batch of rows (None: null rows)."""
        out = {}
        shape = (len(rows), 1) if self.batched else (1,)
        values = [self.control_values(r) for r in rows]
        for _, name, dt, _, _ in self.controls:
            out[name] = np.array([v[name] for v in values], dt).reshape(shape)
        if self.corrid is not None:
            name, dtype = self.corrid
            ids = [r.corrid if r is not None else None for r in rows]
            if dtype == BYTES:
                arr = np.array([(str(i) if i is not None else "").encode() for i in ids], object)
            else:
                arr = np.array([i or 0 for i in ids], numpy_dtype(dtype))
            out[name] = arr.reshape(shape)
        for input_name, initial in self.initial.items():
            states = [self.slots[r.sequence_slot][1][input_name] if r is not None else initial
                      for r in rows]
            out[input_name] = np.stack(states) if self.batched else states[0]
        return out

    def keep(self, rows: list, outputs: dict) -> None:
        """The state outputs of an execution become each row's slot's state. Raises
        SequenceError if the model did not produce one."""
        for input_name, output_name in self.outputs.items():
            if output_name not in outputs:
                raise SequenceError(Status.INTERNAL, f"model '{self.name}' did not produce its "
                                    f"state output '{output_name}'")
            arr = np.asarray(outputs[output_name])
            for i, r in enumerate(rows):
                if r is not None:
                    self.slots[r.sequence_slot][1][input_name] = (
                        np.array(arr[i]) if self.batched else np.array(arr))
