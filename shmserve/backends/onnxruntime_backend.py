"""ONNX Runtime backend. Session options come from the config, named as Triton's
onnxruntime backend names them (its README):

  parameters (string values)
    intra_op_thread_count   threads within a node (default 1 here: one worker process
                            per instance already gives parallelism, and the machine is
                            shared; 0 lets ONNX Runtime pick, Triton's default)
    inter_op_thread_count   threads across nodes (default 1; 0: ONNX Runtime's choice)
    execution_mode          0 sequential (default), 1 parallel
    enable_mem_arena        CPU memory arena on/off
    enable_mem_pattern      memory pattern optimization on/off
    session.use_device_allocator_for_initializers   "0"/"1", passed to the session
    memory.enable_memory_arena_shrinkage            passed to every run
  optimization { graph { level } }
    -1 basic, 1 basic and extended, 2 none, 0 or unset all (ORT_ENABLE_ALL)
  optimization { execution_accelerators { cpu_execution_accelerator [ { name } ] } }
    "openvino": ONNX Runtime's OpenVINOExecutionProvider (onnxruntime-openvino). An
    onnxruntime without it makes the model UNAVAILABLE, naming what is missing (a
    Triton built without OpenVINO refuses the model too); any other name is refused.
  ... gpu_execution_accelerator [ { name: "tensorrt" | "cuda" } ]
    GPU instances (server/devices.py) run on ONNX Runtime's CUDAExecutionProvider
    (onnxruntime-gpu), with TensorrtExecutionProvider before it for "tensorrt" (its
    parameters passed as provider options); an onnxruntime without them makes the
    instance UNAVAILABLE, naming what is missing. As Triton, CPU instances ignore GPU
    accelerators, each with a warning naming it.
"""
from __future__ import annotations

import logging

from ..errors import ConfigError, UnavailableError
from ..server.devices import local_ordinal
from . import params as P

log = logging.getLogger("shmserve.repository")

# optimization.graph.level -> GraphOptimizationLevel name (Triton's mapping; 0 and any
# other value keep ONNX Runtime's default, every optimization)
GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL",
                0: "ORT_ENABLE_ALL"}
CPU_ACCELERATORS = {"openvino": "OpenVINOExecutionProvider"}
GPU_ACCELERATORS = ("tensorrt", "cuda")
DEVICE_ALLOCATOR = "session.use_device_allocator_for_initializers"
ARENA_SHRINKAGE = "memory.enable_memory_arena_shrinkage"


def check_config(cfg, where: str) -> None:
    """Refuses a parameter or accelerator ONNX Runtime would refuse, by name; warns of
    the options that cannot apply here."""
    options(P.of(cfg), where)
    level = cfg.optimization.graph.level
    if cfg.optimization.HasField("graph") and level not in GRAPH_LEVELS:
        log.warning("%s: optimization graph level %d is not one of -1, 0, 1, 2: every graph "
                    "optimization stays on (as Triton does)", where, level)
    accelerators = cfg.optimization.execution_accelerators
    for ea in accelerators.cpu_execution_accelerator:
        if ea.name not in CPU_ACCELERATORS:
            raise ConfigError(f"{where}: optimization execution_accelerators "
                              f"cpu_execution_accelerator '{ea.name}' is unknown (the "
                              "onnxruntime backend knows 'openvino')")
    for ea in accelerators.gpu_execution_accelerator:
        if ea.name not in GPU_ACCELERATORS:
            raise ConfigError(f"{where}: optimization execution_accelerators "
                              f"gpu_execution_accelerator '{ea.name}' is unknown (the "
                              "onnxruntime backend knows 'tensorrt' and 'cuda')")
    if P.flag(P.of(cfg), "share_session_between_instances", False, where):
        log.warning('%s: parameters "share_session_between_instances" is ignored: each '
                    "instance is a process of its own, with its own session", where)


def options(params: dict, where: str) -> dict:
    """The session and run options the parameters ask for, checked."""
    out = {
        "intra_op_num_threads": P.integer(params, "intra_op_thread_count", 1, where, minimum=0),
        "inter_op_num_threads": P.integer(params, "inter_op_thread_count", 1, where, minimum=0),
        "execution_mode": P.integer(params, "execution_mode", 0, where, choices=(0, 1)),
    }
    for key, attr in (("enable_mem_arena", "enable_cpu_mem_arena"),
                      ("enable_mem_pattern", "enable_mem_pattern")):
        if key in params:
            out[attr] = P.flag(params, key, True, where)
    if DEVICE_ALLOCATOR in params:
        out[DEVICE_ALLOCATOR] = "1" if P.flag(params, DEVICE_ALLOCATOR, False, where) else "0"
    if ARENA_SHRINKAGE in params:
        out[ARENA_SHRINKAGE] = params[ARENA_SHRINKAGE]
    return out


def gpu_providers(cfg, where: str, available: list[str], device_id: int) -> list:
    """The execution providers of a GPU instance, in ONNX Runtime's order of preference."""
    providers = []
    for ea in cfg.optimization.execution_accelerators.gpu_execution_accelerator:
        if ea.name == "tensorrt":
            providers.append(("TensorrtExecutionProvider",
                              {"device_id": device_id, **dict(ea.parameters)}))
    providers.append(("CUDAExecutionProvider", {"device_id": device_id}))
    missing = [p for p, _ in providers if p not in available]
    if missing:
        raise UnavailableError(f"{where}: a GPU instance needs ONNX Runtime's "
                               f"{' and '.join(missing)}, which this onnxruntime lacks (it has "
                               f"{', '.join(available)}; pip install onnxruntime-gpu)")
    return providers


class Backend:
    def __init__(self, spec, instance):
        import onnxruntime as ort

        where = f"model '{spec.name}' version {spec.version}"
        cfg = spec.config()
        opts, wanted = ort.SessionOptions(), options(spec.parameters, where)
        opts.intra_op_num_threads = wanted["intra_op_num_threads"]
        opts.inter_op_num_threads = wanted["inter_op_num_threads"]
        opts.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if wanted["execution_mode"]
                               else ort.ExecutionMode.ORT_SEQUENTIAL)
        level = GRAPH_LEVELS.get(cfg.optimization.graph.level, "ORT_ENABLE_ALL")
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        for attr in ("enable_cpu_mem_arena", "enable_mem_pattern"):
            if attr in wanted:
                setattr(opts, attr, wanted[attr])
        if DEVICE_ALLOCATOR in wanted:
            opts.add_session_config_entry(DEVICE_ALLOCATOR, wanted[DEVICE_ALLOCATOR])
        self.run_options = None
        if ARENA_SHRINKAGE in wanted:
            self.run_options = ort.RunOptions()
            self.run_options.add_run_config_entry(ARENA_SHRINKAGE, wanted[ARENA_SHRINKAGE])
        providers = []
        if instance.kind == "GPU":
            where = f"{where} instance {instance.index} (GPU {instance.device})"
            providers = gpu_providers(cfg, where, ort.get_available_providers(),
                                      local_ordinal(spec.backend, instance.device))
        else:
            for ea in cfg.optimization.execution_accelerators.gpu_execution_accelerator:
                log.warning("%s: optimization execution_accelerators gpu_execution_accelerator "
                            "'%s' is ignored: instance %d runs on the CPU, and Triton applies "
                            "GPU accelerators to GPU instances only", where, ea.name,
                            instance.index)
        for ea in cfg.optimization.execution_accelerators.cpu_execution_accelerator:
            provider = CPU_ACCELERATORS[ea.name]
            if provider not in ort.get_available_providers():
                raise UnavailableError(
                    f"{where}: cpu_execution_accelerator '{ea.name}' needs ONNX Runtime's "
                    f"{provider}, which this onnxruntime {ort.__version__} lacks (it has "
                    f"{', '.join(ort.get_available_providers())}; onnxruntime-openvino has it)")
            providers.append((provider, {"device_type": "CPU"}))
        providers.append("CPUExecutionProvider")
        self.session = ort.InferenceSession(spec.path, sess_options=opts, providers=providers)
        model_inputs = {i.name for i in self.session.get_inputs()}
        model_inputs |= {i.name for i in self.session.get_overridable_initializers()}
        model_outputs = {o.name for o in self.session.get_outputs()}
        for t in spec.inputs:
            if t.name not in model_inputs:
                raise ConfigError(f"{spec.path}: config input '{t.name}' is not an input of the "
                                  f"ONNX graph (graph inputs: {sorted(model_inputs)})")
        for name in spec.extra_inputs():  # control, state and batch_input tensors
            if name not in model_inputs:
                raise ConfigError(f"{spec.path}: '{name}' (a sequence control, state or "
                                  "batch_input of the config) is not an input of the ONNX graph "
                                  f"(graph inputs: {sorted(model_inputs)})")
        self.output_names = [t.name for t in spec.outputs] + spec.extra_outputs()
        for name in self.output_names:
            if name not in model_outputs:
                raise ConfigError(f"{spec.path}: config output '{name}' is not an output of the "
                                  f"ONNX graph (graph outputs: {sorted(model_outputs)})")

    def execute(self, inputs):
        results = self.session.run(self.output_names, inputs, self.run_options)
        return dict(zip(self.output_names, results))

    def close(self):
        self.session = None
