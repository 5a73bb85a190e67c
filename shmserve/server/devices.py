"""Where each model instance runs: the CPU or one GPU, as Triton's instance_group says.

    instance_group [ { kind: KIND_GPU  count: 2  gpus: [ 0, 1 ] } ]   -> 4 instances
    instance_group [ { kind: KIND_AUTO } ]   -> one per visible GPU where the backend
                                                runs on GPUs and one is visible, else CPU

As in Triton, `count` instances go on each listed GPU (all visible GPUs when `gpus` is
empty). The server only plans; whether an instance's GPU can run its backend (a driver,
onnxruntime-gpu, torch with CUDA, TensorRT) is found by its worker when it loads, and
an instance that cannot is UNAVAILABLE with that reason (a machine without a GPU makes
a KIND_GPU model UNAVAILABLE, never stops the server).

GPUs are numbered as the server sees them (after its own CUDA_VISIBLE_DEVICES). A
worker of an onnxruntime, pytorch or tensorrt instance sees only its GPU
(CUDA_VISIBLE_DEVICES=<that GPU>, so its libraries use device 0 and create no context
on the others); a python model's worker sees all of them, because Triton's python
models pick their device from args["model_instance_device_id"].
"""
from __future__ import annotations

import functools
import logging
import os

from ..model_config import mc

from ..errors import ConfigError

log = logging.getLogger("shmserve.coordinator")
CPU = -1  # an instance's device: -1 the CPU, n >= 0 GPU n
GPU_BACKENDS = ("onnxruntime", "pytorch", "tensorrt", "python")  # may run on a GPU
GPU_ONLY_BACKENDS = ("tensorrt",)  # run nowhere else
SEES_EVERY_GPU = ("python",)  # model code chooses its device itself


def nvml():
    """pynvml (PyPI nvidia-ml-py) initialised, or None without the package, a driver
    or a device."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        return pynvml
    except Exception:  # no package, no driver, no device
        return None


def _parse_visible(value: str, count: int, uuids: list[str]) -> list[int]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: indices or (prefixes of) UUIDs, the list
    cut at the first entry that names no device."""
    out = []
    for item in (x.strip() for x in value.split(",")):
        if item.isdigit() and int(item) < count:
            n = int(item)
        else:
            n = next((i for i, u in enumerate(uuids) if item and u.startswith(item)), None)
        if n is None or n in out:
            break
        out.append(n)
    return out


@functools.lru_cache(maxsize=1)
def visible_gpus() -> tuple[int, ...]:
    """The GPUs this process may use, numbered as CUDA numbers them here (0..n-1)."""
    lib = nvml()
    if lib is None:
        return ()
    count = lib.nvmlDeviceGetCount()
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return tuple(range(count))
    uuids = []
    for i in range(count):
        u = lib.nvmlDeviceGetUUID(lib.nvmlDeviceGetHandleByIndex(i))
        uuids.append(u.decode() if isinstance(u, bytes) else u)
    return tuple(range(len(_parse_visible(value, count, uuids))))


def _physical(device: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry that shows a worker the server's GPU `device`."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return str(device)
    entries = [x.strip() for x in value.split(",")]
    return entries[device] if device < len(entries) else str(device)


def instance_devices(cfg: mc.ModelConfig, backend: str, where: str,
                     gpus: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """One device per instance (CPU or a GPU number), in Triton's instance order, and
    cfg's groups completed as Triton completes them (KIND_AUTO resolved, a GPU group's
    gpus listed). `gpus`: the visible GPUs (visible_gpus() when None)."""
    visible = visible_gpus() if gpus is None else tuple(gpus)
    K = mc.ModelInstanceGroup
    devices: list[int] = []
    for group in cfg.instance_group or [K(count=1)]:
        kind, count = group.kind, group.count or 1  # Triton fills an unset count with 1
        name = f"instance_group '{group.name}'" if group.name else "instance_group"
        if kind not in (K.KIND_AUTO, K.KIND_CPU, K.KIND_GPU):
            raise ConfigError(f"{where}: {name} kind {K.Kind.Name(kind)} is not supported "
                              "(KIND_CPU, KIND_GPU and KIND_AUTO are)")
        if count < 1:
            raise ConfigError(f"{where}: {name} count must be >= 1")
        if kind == K.KIND_GPU and backend not in GPU_BACKENDS:
            raise ConfigError(f"{where}: {name} kind KIND_GPU: the {backend} backend runs on "
                              "the CPU only (use KIND_CPU)")
        if kind == K.KIND_CPU and backend in GPU_ONLY_BACKENDS:
            raise ConfigError(f"{where}: {name} kind KIND_CPU: a tensorrt_plan model runs on a "
                              "GPU (use KIND_GPU or leave kind out)")
        if kind == K.KIND_CPU and group.gpus:
            raise ConfigError(f"{where}: {name} kind KIND_CPU lists gpus {list(group.gpus)}: "
                              "a CPU instance takes no GPU (use KIND_GPU)")
        on_gpu = kind == K.KIND_GPU or (kind == K.KIND_AUTO and backend in GPU_BACKENDS
                                        and (visible or backend in GPU_ONLY_BACKENDS))
        if not on_gpu:
            group.kind = K.KIND_CPU
            devices += [CPU] * count
            continue
        group.kind = K.KIND_GPU
        listed = list(group.gpus)
        for g in listed:
            if visible and g not in visible:
                raise ConfigError(f"{where}: {name} lists GPU {g}, which this server does not "
                                  f"see (visible GPUs: {list(visible)})")
        # No GPU visible: the instance is planned on GPU 0 and its worker says why it
        # cannot load (UNAVAILABLE, with the reason), as a missing library would.
        if not listed:
            group.gpus.extend(list(visible) or [0])
        for g in group.gpus:
            devices += [g] * count
    return tuple(devices)


def worker_environment(backend: str, device: int) -> dict[str, str]:
    """The environment variables a worker of this instance starts with."""
    if device == CPU or backend in SEES_EVERY_GPU:
        return {}
    return {"CUDA_VISIBLE_DEVICES": _physical(device)}


def local_ordinal(backend: str, device: int) -> int:
    """The CUDA device number a backend uses inside its worker."""
    return device if backend in SEES_EVERY_GPU else 0


def check_pools(cuda_pools: dict[int, int], pinned_bytes: int | None) -> None:
    """Triton's --cuda-memory-pool-byte-size and --pinned-memory-pool-byte-size."""
    visible = visible_gpus()
    for gpu in cuda_pools:
        if gpu not in visible:
            log.warning("--cuda-memory-pool-byte-size %d:...: this server sees no GPU %d "
                        "(visible GPUs: %s): ignored", gpu, gpu, list(visible) or "none")
    if pinned_bytes is not None:
        log.warning("--pinned-memory-pool-byte-size %d is ignored: shmserve does not pin the "
                    "callers' arenas yet (docs/gpu.md)", pinned_bytes)
