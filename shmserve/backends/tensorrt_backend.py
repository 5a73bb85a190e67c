"""TensorRT backend (`backend: "tensorrt"` / `platform: "tensorrt_plan"`): a serialized
engine (default model.plan) run on an NVIDIA GPU with TensorRT 10's Python API
(named I/O tensors, execute_async_v3), device memory and the stream from cupy.

The worker checks first what the engine needs, so that on a machine without a GPU,
without the tensorrt package or without cupy the model is UNAVAILABLE with that
reason (every missing piece named) while the other models serve; nothing is
imported before that check, and nothing here can hang on a machine without a GPU.

Execution (VERIFIED ONLY ON A GPU MACHINE: none was available where this was
written; tests/test_tensorrt.py builds an engine and checks outputs on one, and
skips elsewhere with the reason): each config input and output must be an I/O
tensor of the engine, of the same data type and, where both are fixed, the same
dims. A batch's shapes are set on optimization profile 0 (set_input_shape) after a
check that they lie within its [min, max], which names the input and the bounds;
inputs are copied to the device, the engine runs on the worker's stream, and the
outputs, shaped as the context reports them, are copied back.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..errors import ConfigError, UnavailableError
from ..protocol import DTYPE_NAMES, numpy_dtype

# tensorrt.DataType member name -> Triton data type name
_TRT_TYPES = {"FLOAT": "FP32", "HALF": "FP16", "BF16": "BF16", "INT8": "INT8", "INT32": "INT32",
              "INT64": "INT64", "BOOL": "BOOL", "UINT8": "UINT8"}


def gpu_problem() -> str | None:
    """Why this machine cannot run CUDA work, or None when it has a GPU. Asks the
    NVIDIA driver (libcuda) directly: no CUDA toolkit or Python package is needed."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "this machine has no NVIDIA GPU driver (libcuda.so.1 cannot be loaded)"
    rc = cuda.cuInit(0)
    if rc != 0:
        return f"the NVIDIA driver finds no usable GPU (cuInit error {rc})"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "the NVIDIA driver reports no GPU"
    return None


def missing_pieces() -> list[str]:
    """Everything the backend lacks on this machine, in words."""
    missing = []
    gpu = gpu_problem()
    if gpu:
        missing.append(gpu)
    for module, install in (("tensorrt", "pip install --extra-index-url https://pypi.nvidia.com "
                                         "'shmserve[tensorrt]'"),
                            ("cupy", "pip install 'shmserve[gpu]'")):
        try:
            __import__(module)
        except ImportError as e:
            missing.append(f"the {module} package is not installed ({install}: {e})")
    return missing


class Backend:
    def __init__(self, spec, instance):  # its worker sees only its GPU (server/devices.py)
        where = f"model '{spec.name}' version {spec.version}"
        missing = missing_pieces()
        if missing:
            raise UnavailableError(f"{where}: a tensorrt_plan model runs on an NVIDIA GPU with "
                                   "TensorRT, and " + "; and ".join(missing))
        import cupy
        import tensorrt as trt

        self.spec, self.cupy, self.trt = spec, cupy, trt
        if instance.cuda_pool_bytes:  # the staging buffers below come from cupy's pool
            cupy.get_default_memory_pool().set_limit(size=instance.cuda_pool_bytes)
        self.logger = trt.Logger(trt.Logger.WARNING)
        with open(spec.path, "rb") as f:
            plan = f.read()
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise ConfigError(f"{spec.path}: TensorRT {trt.__version__} cannot deserialize this "
                              "plan (built by another TensorRT version, or for another GPU?)")
        self.context = self.engine.create_execution_context()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        if self.engine.num_optimization_profiles > 0:
            self.context.set_optimization_profile_async(0, self.stream.ptr)
        self._check_io(where)

    def _check_io(self, where: str) -> None:
        trt, engine = self.trt, self.engine
        if self.spec.extra_outputs():
            raise ConfigError(f"{where}: sequence_batching state with a TensorRT plan is not "
                              "implemented by shmserve yet (its state outputs are not fetched)")
        io = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        batched = self.spec.max_batch_size > 0
        for kind, tensors, mode in (("input", self.spec.inputs, trt.TensorIOMode.INPUT),
                                    ("output", self.spec.outputs, trt.TensorIOMode.OUTPUT)):
            for t in tensors:
                if t.name not in io or engine.get_tensor_mode(t.name) != mode:
                    raise ConfigError(f"{self.spec.path}: config {kind} '{t.name}' is not an "
                                      f"{kind} of the engine (I/O tensors: {sorted(io)})")
                trt_type = _TRT_TYPES.get(engine.get_tensor_dtype(t.name).name)
                if trt_type != DTYPE_NAMES[t.dtype]:
                    raise ConfigError(f"{where}: {kind} '{t.name}' is TYPE_{DTYPE_NAMES[t.dtype]} "
                                      f"in the config, {engine.get_tensor_dtype(t.name)} in the "
                                      "engine")
                shape = tuple(engine.get_tensor_shape(t.name))
                model_dims = t.reshape if t.reshape is not None else t.dims
                engine_dims = shape[1:] if batched else shape
                if len(engine_dims) != len(model_dims) or any(
                        a != b and a != -1 and b != -1 for a, b in zip(engine_dims, model_dims)):
                    raise ConfigError(f"{where}: {kind} '{t.name}' has shape {list(shape)} in "
                                      f"the engine, the config says {list(model_dims)}"
                                      + (" after the batch dimension" if batched else ""))
                if kind == "input" and batched and self.engine.num_optimization_profiles > 0:
                    _, _, high = engine.get_tensor_profile_shape(t.name, 0)
                    if high[0] < self.spec.max_batch_size:
                        raise ConfigError(f"{where}: input '{t.name}': optimization profile 0 "
                                          f"allows batches up to {high[0]}, max_batch_size is "
                                          f"{self.spec.max_batch_size}")

    def execute(self, inputs: dict) -> dict:
        cupy, context = self.cupy, self.context
        keep = []  # device buffers live until the copies back are done
        with self.stream:
            for name, arr in inputs.items():
                if self.engine.num_optimization_profiles > 0:
                    low, _, high = self.engine.get_tensor_profile_shape(name, 0)
                    if len(low) != arr.ndim or any(not lo <= n <= hi for lo, n, hi
                                                   in zip(low, arr.shape, high)):
                        raise ValueError(f"input '{name}' shape {list(arr.shape)} is outside "
                                         f"optimization profile 0: {list(low)} to {list(high)}")
                if not context.set_input_shape(name, arr.shape):
                    raise ValueError(f"TensorRT refused shape {list(arr.shape)} for input '{name}'")
                device = cupy.asarray(np.ascontiguousarray(arr))
                keep.append(device)
                context.set_tensor_address(name, device.data.ptr)
            outputs = {}
            for t in self.spec.outputs:
                device = cupy.empty(tuple(context.get_tensor_shape(t.name)), numpy_dtype(t.dtype))
                keep.append(device)
                context.set_tensor_address(t.name, device.data.ptr)
                outputs[t.name] = device
            if not context.execute_async_v3(self.stream.ptr):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the server log)")
            host = {name: cupy.asnumpy(d, stream=self.stream) for name, d in outputs.items()}
            self.stream.synchronize()
        return host

    def close(self):
        self.context = self.engine = None
