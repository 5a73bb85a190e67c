"""Triton's auto-complete of a model configuration, for the onnxruntime and python
backends.

An ONNX model needs no config.pbtxt, or one that leaves out `input`/`output`/
`max_batch_size`: what is missing is read from the model file's graph, as Triton's
onnxruntime backend does (`--disable-auto-complete-config` turns it off):

- each graph input (initializers excluded) and output gives a tensor: its name, its
  element type as Triton's data type, its shape with symbolic or unknown dims as -1;
- the model can batch when every input and output has a variable first dimension;
  then a config that says nothing of max_batch_size (0, and no `dims` of the config
  telling otherwise by their rank) gets Triton's `default-max-batch-size`, 4, the
  batch dimension is left out of `dims`, and dynamic batching is turned on when no
  scheduler is configured (as Triton's onnxruntime backend does with its default);
- a tensor the config names is checked against the graph: a name the graph lacks or
  a data type that disagrees is a ConfigError naming the file, the tensor and both
  values; a data type or dims the config leaves out is filled in.

A python model needs no config.pbtxt either (its backend is known from
`<version>/model.py`) when its TritonPythonModel has the static hook
`auto_complete_config(auto_complete_model_config)`: it is called, as in Triton, with
the config so far (shmserve.pb_utils.ModelConfig) and its setters' max_batch_size,
inputs, outputs, dynamic batching and transaction policy are taken back. The hook
runs in a process of its own (backends/python_autocomplete.py), only for a model.py
that defines it (read with `ast`, not run).
"""
from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..model_config import mc

from ..errors import ConfigError

DEFAULT_MAX_BATCH_SIZE = 4  # Triton's --backend-config=default-max-batch-size default
ONNX_PLATFORM, ONNX_BACKEND, ONNX_FILE = "onnxruntime_onnx", "onnxruntime", "model.onnx"
PYTHON_BACKEND, PYTHON_FILE = "python", "model.py"
HOOK_TIMEOUT_S = 120.0  # a python auto_complete_config that runs longer fails the model

# onnx.TensorProto.DataType name -> Triton DataType name (Triton's datatype table)
_ONNX_TO_TRITON = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
    "FLOAT16": "TYPE_FP16", "FLOAT": "TYPE_FP32", "DOUBLE": "TYPE_FP64",
    "STRING": "TYPE_STRING", "BFLOAT16": "TYPE_BF16",
}


def graph_tensors(model_path: str | Path) -> tuple[list[tuple[str, int, list[int]]],
                                                    list[tuple[str, int, list[int]]]]:
    """The graph's inputs and outputs as (name, Triton DataType, full dims with -1 for
    a symbolic or unknown dim). An element type Triton has no data type for is
    TYPE_INVALID (an error only if the tensor ends up in the config)."""
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # a corrupt or truncated file
        raise ConfigError(f"{model_path}: not a readable ONNX model ({e})") from None
    graph = model.graph
    initializers = {t.name for t in graph.initializer}

    def tensors(values):
        out = []
        for v in values:
            if v.name in initializers:
                continue
            tt = v.type.tensor_type
            onnx_type = onnx.TensorProto.DataType.Name(tt.elem_type)
            dtype = mc.DataType.Value(_ONNX_TO_TRITON.get(onnx_type, "TYPE_INVALID"))
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                    for d in tt.shape.dim] if tt.HasField("shape") else [-1]
            out.append((v.name, dtype, dims))
        return out

    return tensors(graph.input), tensors(graph.output)


def find_model_file(model_dir: Path, file_name: str) -> Path | None:
    """<highest version directory holding file_name>/file_name, if any."""
    versions = sorted((int(p.name) for p in model_dir.iterdir()
                       if p.is_dir() and p.name.isdigit() and (p / file_name).is_file()))
    return model_dir / str(versions[-1]) / file_name if versions else None


def find_onnx_model(model_dir: Path) -> Path | None:
    """The model file of the highest version directory holding model.onnx, if any."""
    return find_model_file(model_dir, ONNX_FILE)


def find_python_model(model_dir: Path) -> Path | None:
    """The model.py of the highest version directory holding one, if any."""
    return find_model_file(model_dir, PYTHON_FILE)


def _type_name(dtype: int) -> str:
    return mc.DataType.Name(dtype)


def complete_onnx_config(cfg: mc.ModelConfig, model_path: Path, where: str,
                         default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
    """Completes cfg (in place) from the ONNX graph at model_path; `where` (the config
    file, or the model directory when there is none) starts every error message."""
    g_inputs, g_outputs = graph_tensors(model_path)
    if not cfg.backend:
        cfg.backend = ONNX_BACKEND
    if not cfg.platform:
        cfg.platform = ONNX_PLATFORM
    if not cfg.default_model_filename:
        cfg.default_model_filename = ONNX_FILE
    graph = {"input": {n: (t, d) for n, t, d in g_inputs},
             "output": {n: (t, d) for n, t, d in g_outputs}}

    # Can the model batch: every input and output has a variable first dimension.
    can_batch = all(d and d[0] == -1 for _, _, d in g_inputs + g_outputs)
    if cfg.max_batch_size > 0 and not can_batch:
        fixed = next(n for n, _, d in g_inputs + g_outputs if not d or d[0] != -1)
        raise ConfigError(f"{where}: max_batch_size {cfg.max_batch_size} but the ONNX graph "
                          f"({model_path}) cannot batch: tensor '{fixed}' has no variable "
                          f"first dimension")
    batched = cfg.max_batch_size > 0
    if can_batch and cfg.max_batch_size == 0:
        # 0 is either "not said" or "no batching": the rank of dims the config gives
        # tells which (Triton's onnxruntime backend reads the same hint).
        hint = None
        for kind, items in (("input", cfg.input), ("output", cfg.output)):
            for t in items:
                if t.dims and t.name in graph[kind]:
                    says = len(graph[kind][t.name][1]) == len(t.dims) + 1
                    if hint is not None and hint != says:
                        raise ConfigError(f"{where}: the dims of the config's tensors disagree "
                                          "on whether the model batches (compare their rank "
                                          f"with the ONNX graph's, {model_path})")
                    hint = says
        if hint is None or hint:
            cfg.max_batch_size = default_max_batch_size
            batched = default_max_batch_size > 0
            if default_max_batch_size > 1 and not (cfg.HasField("dynamic_batching")
                                                   or cfg.HasField("sequence_batching")):
                cfg.dynamic_batching.SetInParent()

    for kind, items in (("input", cfg.input), ("output", cfg.output)):
        known = graph[kind]
        if not items:  # the config says nothing: every tensor of the graph
            for name, (dtype, dims) in known.items():
                if dtype == mc.TYPE_INVALID:
                    raise ConfigError(f"{where}: {kind} '{name}' of the ONNX graph has an "
                                      "element type Triton has no data type for")
                items.add(name=name, data_type=dtype, dims=dims[1:] if batched else dims)
            continue
        for t in items:
            if t.name not in known:
                raise ConfigError(f"{where}: {kind} '{t.name}' is not an {kind} of the ONNX "
                                  f"graph {model_path} (graph {kind}s: {sorted(known)})")
            dtype, dims = known[t.name]
            if t.data_type == mc.TYPE_INVALID:
                t.data_type = dtype
            elif t.data_type != dtype:
                raise ConfigError(f"{where}: {kind} '{t.name}' has data_type "
                                  f"{_type_name(t.data_type)} in the config but "
                                  f"{_type_name(dtype)} in the ONNX graph {model_path}")
            if not t.dims:
                t.dims.extend(dims[1:] if batched else dims)


# -- python models: TritonPythonModel.auto_complete_config ---------------------------------
def defines_auto_complete(model_py: Path) -> bool:
    """Whether model.py's TritonPythonModel defines auto_complete_config (read, not
    run; a file that does not parse is left to the worker, which reports it)."""
    try:
        tree = ast.parse(model_py.read_text(), str(model_py))
    except (SyntaxError, ValueError, OSError):
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel"
               and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and f.name == "auto_complete_config" for f in node.body)
               for node in tree.body)


def complete_python_config(cfg: mc.ModelConfig, model_py: Path, where: str) -> None:
    """Completes cfg (in place) with model_py's auto_complete_config hook, if it has
    one. A hook that raises, returns something else or runs past HOOK_TIMEOUT_S is a
    ConfigError naming the file and what went wrong."""
    from ..logs import AppendHandler, LogOptions
    from ..pb_utils.config import apply_auto_complete, config_dict

    if not defines_auto_complete(model_py):
        return
    # said at info, with the file as `model_code`: `shmserve validate` reports model code it ran
    logging.getLogger("shmserve.repository").info(
        "%s: running auto_complete_config of %s (in a process of its own)", where, model_py,
        extra={"model_code": str(model_py)})
    # the child logs as this process does (the server's handler holds its options)
    log_options = next((h.opts for h in logging.getLogger().handlers
                        if isinstance(h, AppendHandler)), LogOptions())
    message = json.dumps({"config": config_dict(cfg), "log": log_options.as_dict()})
    with tempfile.TemporaryDirectory(prefix="shmserve-autocomplete-") as tmp:
        result_path = Path(tmp) / "config.json"
        # the hook's prints and logs go to the server log (our stderr), never a pipe we read
        proc = subprocess.Popen([sys.executable, "-m", "shmserve.backends.python_autocomplete",
                                 str(model_py), str(result_path)],
                                stdin=subprocess.PIPE, stdout=2, stderr=2, env=os.environ.copy())
        try:
            proc.communicate(message.encode(), timeout=HOOK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise ConfigError(f"{where}: {model_py} auto_complete_config did not return within "
                              f"{HOOK_TIMEOUT_S:g} s") from None
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            result = {"error": f"the process running it ended with status {proc.returncode} "
                               "without a result (see the log above)"}
    if "error" in result:
        raise ConfigError(f"{where}: {model_py} auto_complete_config failed: {result['error']}")
    try:
        apply_auto_complete(cfg, result["config"], where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
