"""config.pbtxt `sequence_batching`, read and checked as Triton does (the coordinator
reads it once; the batcher's scheduling/sequence.py and the worker's sequence.py use
what parse() returns, a plain dict carried in ModelSpec.sequence).

    sequence_batching {
      max_sequence_idle_microseconds: 5000000        # Triton's default 1 s
      direct { max_queue_delay_microseconds: 0  minimum_slot_utilization: 0.0 }
      # or: oldest { max_candidate_sequences: 4  preferred_batch_size: [2, 4]
      #              max_queue_delay_microseconds: 100 }
      control_input [
        { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } ] },
        { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
      ]
      state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [1]
                initial_state { name: "zeros" data_type: TYPE_FP32 dims: [1] zero_data: true } } ]
    }

Control and state tensors are not among the model's `input`/`output`: the server feeds
them (the worker), callers never send or see them."""
from __future__ import annotations

import logging
from pathlib import Path

from ..model_config import mc

from ..errors import ConfigError
from ..protocol import DTYPE_CODES, numpy_dtype

SB = mc.ModelSequenceBatching
KINDS = {SB.Control.CONTROL_SEQUENCE_START: "START", SB.Control.CONTROL_SEQUENCE_END: "END",
         SB.Control.CONTROL_SEQUENCE_READY: "READY", SB.Control.CONTROL_SEQUENCE_CORRID: "CORRID"}
CORRID_TYPES = {"TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING"}
IDLE_US_DEFAULT = 1_000_000  # Triton's max_sequence_idle_microseconds default
log = logging.getLogger("shmserve.repository")


def _dtype(data_type: int, where: str) -> int:
    name = mc.DataType.Name(data_type)
    if name == "TYPE_STRING":
        return DTYPE_CODES["BYTES"]
    code = DTYPE_CODES.get(name.removeprefix("TYPE_"))
    if code is None:
        raise ConfigError(f"{where}: data_type {name} is not supported")
    return code


def parse(cfg: mc.ModelConfig, model_dir: Path, where: str) -> dict | None:
    """The model's sequence batching settings, or None without sequence_batching.
    Raises ConfigError naming the field at fault."""
    if not cfg.HasField("sequence_batching"):
        return None
    sb = cfg.sequence_batching
    where = f"{where}: sequence_batching"
    if sb.iterative_sequence:
        raise ConfigError(f"{where}: iterative_sequence is not implemented by shmserve yet")
    # Set, these only change how memory is used or when answers go: loaded, named.
    ignored = [f"oldest {f}" for f in ("preserve_ordering",) if getattr(sb.oldest, f)]
    ignored += [f"state '{st.input_name}' {f}" for st in sb.state
                for f in ("use_same_buffer_for_input_output", "use_growable_memory")
                if getattr(st, f)]
    for what in ignored:
        log.warning("%s: %s is not implemented by shmserve yet and is ignored", where, what)
    max_batch = max(int(cfg.max_batch_size), 1)
    taken = {t.name for t in (*cfg.input, *cfg.output)}
    out = {"strategy": "oldest" if sb.HasField("oldest") else "direct",
           "idle_us": int(sb.max_sequence_idle_microseconds) or IDLE_US_DEFAULT,
           "delay_us": 0, "min_slot_utilization": 0.0, "max_candidates": max_batch,
           "preferred": [], "controls": [], "corrid": None, "states": []}
    if sb.HasField("oldest"):
        o = sb.oldest
        out["max_candidates"] = int(o.max_candidate_sequences) or max_batch
        out["preferred"] = sorted(int(p) for p in o.preferred_batch_size)
        out["delay_us"] = int(o.max_queue_delay_microseconds)
        if any(not 1 <= p <= max_batch for p in out["preferred"]):
            raise ConfigError(f"{where}: oldest preferred_batch_size {out['preferred']} must lie "
                              f"in 1..max_batch_size ({max_batch})")
    else:
        out["delay_us"] = int(sb.direct.max_queue_delay_microseconds)
        out["min_slot_utilization"] = float(sb.direct.minimum_slot_utilization)
        if not 0.0 <= out["min_slot_utilization"] <= 1.0:
            raise ConfigError(f"{where}: direct minimum_slot_utilization must lie in 0..1")
    seen_kinds = set()
    for ci in sb.control_input:
        cw = f"{where}: control_input '{ci.name}'"
        if not ci.name or ci.name in taken:
            raise ConfigError(f"{cw}: needs a name that no input or output of the model has")
        if len(ci.control) != 1:
            raise ConfigError(f"{cw}: needs exactly one control (got {len(ci.control)})")
        taken.add(ci.name)
        c = ci.control[0]
        kind = KINDS[c.kind]
        if kind in seen_kinds:
            raise ConfigError(f"{cw}: CONTROL_SEQUENCE_{kind} is given twice")
        seen_kinds.add(kind)
        if kind == "CORRID":
            type_name = mc.DataType.Name(c.data_type)
            if type_name not in CORRID_TYPES:
                raise ConfigError(f"{cw}: CONTROL_SEQUENCE_CORRID data_type must be one of "
                                  f"{', '.join(sorted(CORRID_TYPES))}, got {type_name}")
            out["corrid"] = [ci.name, _dtype(c.data_type, cw)]
            continue
        given = [(values, dtype) for values, dtype in
                 ((list(c.int32_false_true), "INT32"), (list(c.fp32_false_true), "FP32"),
                  (list(c.bool_false_true), "BOOL")) if values]
        if len(given) != 1 or len(given[0][0]) != 2:
            raise ConfigError(f"{cw}: CONTROL_SEQUENCE_{kind} needs exactly one of "
                              "int32_false_true, fp32_false_true, bool_false_true, of two values")
        (false_value, true_value), dtype = given[0]
        out["controls"].append([kind, ci.name, DTYPE_CODES[dtype], false_value, true_value])
    for st in sb.state:
        sw = f"{where}: state '{st.input_name}'"
        if not st.input_name or not st.output_name or {st.input_name, st.output_name} & taken:
            raise ConfigError(f"{sw}: input_name and output_name must be set and differ from "
                              "the model's inputs, outputs and control inputs")
        taken |= {st.input_name, st.output_name}
        dtype = _dtype(st.data_type, sw)
        if dtype == DTYPE_CODES["BYTES"]:
            raise ConfigError(f"{sw}: TYPE_STRING state is not implemented by shmserve yet")
        if len(st.initial_state) > 1:
            raise ConfigError(f"{sw}: at most one initial_state")
        dims = [int(d) for d in st.dims]
        initial_dims, data_file = dims, ""
        if st.initial_state:
            init = st.initial_state[0]
            initial_dims = [int(d) for d in init.dims]
            if init.data_type != st.data_type:
                raise ConfigError(f"{sw}: initial_state data_type differs from the state's")
            if init.HasField("data_file"):
                path = model_dir / "initial_state" / init.data_file
                count = 1
                for d in initial_dims:
                    count *= d
                want = count * numpy_dtype(dtype).itemsize
                if not path.is_file() or path.stat().st_size != want:
                    raise ConfigError(f"{sw}: initial_state data_file {path} must exist and hold "
                                      f"{want} bytes (dims {initial_dims})")
                data_file = str(path)
            elif not init.zero_data:
                raise ConfigError(f"{sw}: initial_state needs zero_data: true or a data_file")
        if any(d < 0 for d in initial_dims):
            raise ConfigError(f"{sw}: dims {initial_dims} of the initial state must be fixed "
                              "(give initial_state dims)")
        out["states"].append([st.input_name, st.output_name, dtype, initial_dims, data_file])
    return out
