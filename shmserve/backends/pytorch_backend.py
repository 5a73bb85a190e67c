"""PyTorch backend (`backend: "pytorch"` / `platform: "pytorch_libtorch"`), on the CPU
or a GPU (docs/gpu.md: callers' device tensors by CUDA IPC, page-locked arenas).

The model file (default_model_filename, default model.pt) is a TorchScript module
(torch.jit.save: model.pt) or, for a name ending in .pt2, a torch.export program
(torch.export.save), run through its module(). torch is imported here, in the
worker, only: without torch the model is UNAVAILABLE with that reason.

Tensors map to the model as Triton's pytorch backend maps them (its README):
- inputs: if every config input is named after an argument of forward(), by name;
  else if every one is named <name>__<index>, by that index; else in config order.
  A forward() taking a single Dict[str, Tensor] gets the inputs keyed by name.
  An `optional` input a request left out is passed as None (a Dict: left out).
- outputs: forward() returns a Tensor, or a tuple/list of them: by <name>__<index>
  when every config output is named so, else in config order. A Dict[str, Tensor]
  is also accepted (shmserve's addition; Triton refuses it): by name.
- BYTES tensors are List[str] on the torch side, one dimension (the batch one when
  the model batches), as in Triton.

Parameters (string values), Triton's where they apply on a CPU:
  INFERENCE_MODE (default true), DISABLE_OPTIMIZED_EXECUTION (default false),
  ENABLE_JIT_EXECUTOR, ENABLE_JIT_PROFILING, ENABLE_TENSOR_FUSER (unset: torch's
  own defaults), INTRA_OP_THREAD_COUNT, INTER_OP_THREAD_COUNT (default 1 here: one
  process per instance already runs instances in parallel; 0: torch's default,
  every core, Triton's default). The JIT ones apply to TorchScript only.
  ENABLE_WEIGHT_SHARING, ENABLE_CACHE_CLEANING, ENABLE_NVFUSER and DISABLE_CUDNN
  have no effect on CPU instances in separate processes: a warning names them.
"""
from __future__ import annotations

import logging

import numpy as np
from ..model_config import mc

from ..errors import ConfigError, UnavailableError
from ..protocol import DataType
from ..server.devices import local_ordinal
from . import params as P

log = logging.getLogger("shmserve.repository")
wlog = logging.getLogger("shmserve.worker")

FLAGS = ("INFERENCE_MODE", "DISABLE_OPTIMIZED_EXECUTION", "ENABLE_JIT_EXECUTOR",
         "ENABLE_JIT_PROFILING", "ENABLE_TENSOR_FUSER")
NO_EFFECT = ("ENABLE_WEIGHT_SHARING", "ENABLE_CACHE_CLEANING", "ENABLE_NVFUSER", "DISABLE_CUDNN")


def _named_index(name: str) -> int | None:
    """<name>__<index> -> index, as Triton reads it (the digits after the first '__')."""
    head, sep, tail = name.partition("__")
    return int(tail) if sep and tail.isdigit() else None


def check_config(cfg, where: str) -> None:
    params = P.of(cfg)
    for key in FLAGS + NO_EFFECT:
        P.flag(params, key, False, where)
    for key in ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT"):
        P.integer(params, key, 1, where, minimum=0)
    for key in NO_EFFECT:
        if key in params:
            log.warning('%s: parameters "%s" has no effect here (CPU instances, each a process '
                        "of its own) and is ignored", where, key)
    batched = cfg.max_batch_size > 0
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        for t in tensors:
            dims = t.reshape.shape if t.HasField("reshape") else t.dims
            if t.data_type == mc.TYPE_STRING and len(dims) + batched > 1:  # List[str]
                raise ConfigError(f"{where}: {kind} '{t.name}': the pytorch backend takes "
                                  "BYTES (TYPE_STRING) tensors as List[str], of one dimension "
                                  "(the batch one when the model batches)")


class Backend:
    def __init__(self, spec, instance):
        where = f"model '{spec.name}' version {spec.version}"
        try:
            import torch
        except ImportError as e:
            raise UnavailableError(f"{where}: the pytorch backend needs torch, which is not "
                                   f"installed ({e}; pip install 'shmserve[torch]')") from None
        self.torch, self.spec = torch, spec
        # set by a worker that reads callers' device memory (gpu/ipc.py): outputs stay
        # torch tensors on the GPU, copied by the worker into a caller's arena or device buffer
        self.outputs_on_device = False
        self.device = torch.device("cpu")
        if instance.kind == "GPU":
            if not torch.cuda.is_available():
                raise UnavailableError(
                    f"{where}: instance {instance.index} is on GPU {instance.device}, and torch "
                    f"{torch.__version__} sees no CUDA device (a CPU build, or no driver)")
            self.device = torch.device("cuda", local_ordinal(spec.backend, instance.device))
        params = spec.parameters
        intra = P.integer(params, "INTRA_OP_THREAD_COUNT", 1, where, minimum=0)
        inter = P.integer(params, "INTER_OP_THREAD_COUNT", 1, where, minimum=0)
        if intra:
            torch.set_num_threads(intra)
        if inter and torch.get_num_interop_threads() != inter:
            try:  # only before any parallel work: a worker is a fresh process
                torch.set_num_interop_threads(inter)
            except RuntimeError as e:
                wlog.warning("%s: INTER_OP_THREAD_COUNT %d not applied: %s", where, inter, e)
        self.inference_mode = P.flag(params, "INFERENCE_MODE", True, where)
        self.exported = spec.path.endswith(".pt2")
        try:
            with torch.inference_mode(self.inference_mode):
                if self.exported:
                    program = torch.export.load(spec.path)
                    self.module = program.module().to(self.device)
                else:
                    self.module = torch.jit.load(spec.path, map_location=self.device)
        except Exception as e:  # a file torch cannot read: say which and how it was read
            how = "torch.export.load" if self.exported else "torch.jit.load (TorchScript)"
            raise ConfigError(f"{spec.path}: {how} failed with torch {torch.__version__}: "
                              f"{type(e).__name__}: {e}") from None
        if not self.exported:
            self._jit_options(params, where)
            self.module.eval()
            args, self.dict_input = self._torchscript_args(where)
        else:
            args, self.dict_input = self._exported_args(program)
        self.input_index = self._input_index(args, where)
        self.output_index = self._output_index()
        self.bytes_outputs = {t.name for t in spec.outputs if t.dtype == DataType.BYTES}

    # -- load: parameters and the mapping of tensors ------------------------------------
    def _jit_options(self, params: dict, where: str) -> None:
        torch = self.torch
        torch._C._set_graph_executor_optimize(
            not P.flag(params, "DISABLE_OPTIMIZED_EXECUTION", False, where))
        if "ENABLE_JIT_EXECUTOR" in params:
            torch._C._jit_set_profiling_executor(P.flag(params, "ENABLE_JIT_EXECUTOR", True, where))
        if "ENABLE_JIT_PROFILING" in params:
            torch._C._jit_set_profiling_mode(P.flag(params, "ENABLE_JIT_PROFILING", True, where))
        if "ENABLE_TENSOR_FUSER" in params:
            torch._C._jit_set_texpr_fuser_enabled(P.flag(params, "ENABLE_TENSOR_FUSER", True, where))

    def _torchscript_args(self, where: str) -> tuple[list[str], bool]:
        """forward()'s argument names, and whether it takes one Dict[str, Tensor]."""
        arguments = list(self.module.forward.schema.arguments)
        if arguments and arguments[0].type.kind() == "ClassType":
            arguments = arguments[1:]  # self
        if len(arguments) == 1 and arguments[0].type.kind() == "DictType":
            return [], True
        for a in arguments:
            if a.type.kind() not in ("TensorType", "ListType", "OptionalType"):
                raise ConfigError(f"{self.spec.path}: forward() argument '{a.name}' is a "
                                  f"{a.type}; the pytorch backend passes Tensor (or List[str]) "
                                  "arguments, or one Dict[str, Tensor]")
        return [a.name for a in arguments], False

    @staticmethod
    def _exported_args(program) -> tuple[list[str], bool]:
        args_spec = program.call_spec.in_spec.child(0)  # (args, kwargs): the args
        children = [args_spec.child(i) for i in range(args_spec.num_children)]
        if len(children) == 1 and children[0].type is dict:
            return [], True
        return list(program.graph_signature.user_inputs), False

    def _input_index(self, args: list[str], where: str) -> dict[str, int]:
        names = [t.name for t in self.spec.inputs] + self.spec.extra_inputs()
        if self.dict_input:
            return {n: i for i, n in enumerate(names)}
        if len(args) != len(names):
            extra = (" with its sequence control, state and batch_input tensors"
                     if self.spec.extra_inputs() else "")
            raise ConfigError(f"{where}: the config has {len(names)} input(s){extra} "
                              f"({', '.join(names)}), the model's forward() takes "
                              f"{len(args)} ({', '.join(args)})")
        if all(n in args for n in names):  # Triton's FORWARD_ARGUMENT convention
            return {n: args.index(n) for n in names}
        indexes = [_named_index(n) for n in names]
        if all(i is not None for i in indexes):  # NAMED_INDEX
            if sorted(indexes) != list(range(len(names))):
                raise ConfigError(f"{where}: inputs named <name>__<index> must number the "
                                  f"model's {len(names)} arguments 0..{len(names) - 1}, got "
                                  f"{', '.join(names)}")
            return dict(zip(names, indexes))
        wlog.warning("%s: inputs %s are neither forward() arguments (%s) nor named "
                     "<name>__<index>: passed in config order (as Triton does)", where,
                     ", ".join(names), ", ".join(args))
        return {n: i for i, n in enumerate(names)}

    def _output_index(self) -> dict[str, int]:
        names = [t.name for t in self.spec.outputs] + self.spec.extra_outputs()
        indexes = [_named_index(n) for n in names]
        if all(i is not None for i in indexes):
            return dict(zip(names, indexes))
        return {n: i for i, n in enumerate(names)}

    # -- execute -------------------------------------------------------------------------
    def _tensor(self, value):
        if isinstance(value, self.torch.Tensor):  # a caller's device tensor (CUDA IPC)
            return value.to(self.device)
        if value.dtype == object:  # BYTES: List[str]
            return [v.decode() if isinstance(v, bytes) else str(v) for v in value.reshape(-1)]
        # From a GPU worker's page-locked arena the copy is one asynchronous DMA, ordered
        # before the model on the same stream; the arena holds the bytes until answered.
        return self.torch.from_numpy(np.ascontiguousarray(value)).to(
            self.device, non_blocking=self.device.type == "cuda")

    def execute(self, inputs: dict) -> dict:
        torch = self.torch
        with torch.inference_mode(self.inference_mode), torch.no_grad():
            if self.dict_input:
                result = self.module({n: self._tensor(v) for n, v in inputs.items()})
            else:
                args = [None] * len(self.input_index)
                for name, value in inputs.items():
                    args[self.input_index[name]] = self._tensor(value)
                result = self.module(*args)
        return self._outputs(result)

    def _outputs(self, result) -> dict:
        if isinstance(result, dict):
            missing = [n for n in self.output_index if n not in result]
            if missing:
                raise ValueError(f"forward() returned a dict without {', '.join(missing)} "
                                 f"(keys: {', '.join(map(str, result))})")
            return {n: self._array(n, result[n]) for n in self.output_index}
        if isinstance(result, list) and all(isinstance(v, str) for v in result):
            result = (result,)  # one List[str] output
        elif not isinstance(result, (tuple, list)):
            result = (result,)
        out = {}
        for name, index in self.output_index.items():
            if index >= len(result):
                raise ValueError(f"output '{name}' is output {index} of forward(), which "
                                 f"returned {len(result)}")
            out[name] = self._array(name, result[index])
        return out

    def _array(self, name: str, value) -> np.ndarray:
        if name in self.bytes_outputs:
            if isinstance(value, self.torch.Tensor):
                raise ValueError(f"output '{name}' is BYTES: forward() must return a List[str] "
                                 "for it, not a Tensor")
            return np.array([v.encode() if isinstance(v, str) else bytes(v) for v in value],
                            dtype=object)
        if not isinstance(value, self.torch.Tensor):
            raise ValueError(f"output '{name}' is a {type(value).__name__}, not a Tensor")
        if self.outputs_on_device:  # the worker copies it once, straight to where it goes
            return value.detach()
        return value.detach().cpu().numpy()

    def close(self):
        self.module = None
