"""The model repository: Triton's layout, config.pbtxt parsed with Triton's schema.

    <repository>/<model name>/config.pbtxt
    <repository>/<model name>/[<labels file> ...]
    <repository>/<model name>/[warmup/<warmup data file> ...]
    <repository>/<model name>/<version>/<model file>

Version directories are named by a number that does not start with 0 (others are
ignored, as Triton does); the config's version_policy picks the versions served.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from google.protobuf import text_format
from ..model_config import mc

from .. import backends
from ..errors import ConfigError
from ..protocol import DTYPE_CODES, MAX_DIMS, MAX_TENSORS, NAME_BYTES, DataType
from . import autocomplete, devices, ensemble, ragged, reshape, sequence_config, unsupported, warmup

log = logging.getLogger("shmserve.repository")

# backend name -> (its platform name, default model file). Triton's config names a
# model's backend, its platform, or both (then they must agree).
BACKENDS = {
    "python": ("python", "model.py"),
    "onnxruntime": ("onnxruntime_onnx", "model.onnx"),
    "pytorch": ("pytorch_libtorch", "model.pt"),
    "tensorrt": ("tensorrt_plan", "model.plan"),
    "ensemble": ("ensemble", ""),  # no model file: its version directory (ensemble.py)
}
_PLATFORM_TO_BACKEND = {p: b for b, (p, _) in BACKENDS.items()}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")  # Triton ignores other names, and those starting with 0


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: int  # protocol / Triton DataType code
    dims: tuple[int, ...]  # without the batch dimension when max_batch_size > 0
    reshape: tuple[int, ...] | None = None  # the model's shape (reshape.py); None: dims
    optional: bool = False  # an input a request may leave out
    label_filename: str = ""  # an output's labels file, in the model directory
    ragged: bool = False  # an input's allow_ragged_batch (ragged.py)

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPE_CODES.items() if v == self.dtype)


# A model whose execution has no side effects may declare (config.pbtxt):
#   parameters { key: "shmserve.retry_on_worker_crash" value { string_value: "true" } }
# and a batch whose worker dies is run once more by its successor instead of failing.
RETRY_PARAMETER = "shmserve.retry_on_worker_crash"

# How a model's queue is shared by several idle instances (scheduling/dynamic.py):
#   parameters { key: "shmserve.instance_balancing" value { string_value: "greedy" } }
# "balanced" (default) splits what is ready to go into near-equal batches, one per idle
# instance; "greedy" is Triton's rule: the first idle instance takes all it can.
BALANCING_PARAMETER = "shmserve.instance_balancing"
BALANCED, GREEDY = "balanced", "greedy"

# Whether the batcher may give a busy instance its next batch, to start as soon as the
# one it runs is done (docs/architecture.md, "Two batches deep"):
#   parameters { key: "shmserve.overlap" value { string_value: "true" } }
# Off by default (on 2 cores it did not pay); ignored with sequence batching or
# preserve_ordering.
OVERLAP_PARAMETER = "shmserve.overlap"

# How many requests one client may hold queued for the model (scheduling/base.py):
#   parameters { key: "shmserve.max_queued_per_client" value { string_value: "16" } }
# Over it a request is refused BUSY; "0" turns the server's --max-queued-per-client off
# for this model. Unset: the server's flag (default 0: no limit; fair share is the
# default protection, docs/reliability.md).
PER_CLIENT_PARAMETER = "shmserve.max_queued_per_client"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    version: int
    backend: str
    path: str  # the model file
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_count: int
    dynamic_batching: bool
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int
    parameters: dict
    config_text: str
    retry_on_worker_crash: bool = False  # re-run a batch once if its worker died in it
    max_queue_size: int = 0  # dynamic_batching.default_queue_policy; 0: unbounded (all slots)
    queue_timeout_us: int = 0  # ... default_timeout_microseconds; 0: none
    queue_delay_on_timeout: bool = False  # ... timeout_action DELAY (else REJECT)
    allow_timeout_override: bool = False  # ... allow_timeout_override
    priority_levels: int = 0  # dynamic_batching.priority_levels; 0: one level
    default_priority_level: int = 0
    # priority_queue_policy: ((level, max_queue_size, timeout_us, delay, allow_override), ...)
    priority_queue_policies: tuple = ()
    preserve_ordering: bool = False  # dynamic_batching.preserve_ordering
    instance_balancing: str = BALANCED  # or GREEDY (BALANCING_PARAMETER)
    overlap: bool = False  # OVERLAP_PARAMETER: a busy instance may hold its next batch
    max_queued_per_client: int | None = None  # PER_CLIENT_PARAMETER; None: the server's flag
    warmup: tuple = ()  # model_warmup samples, as warmup.parse gives them
    sequence: dict | None = None  # sequence_batching, as sequence_config.parse gives it
    devices: tuple[int, ...] = ()  # per instance: devices.CPU or a GPU number; () all CPU
    response_cache: bool = False  # response_cache.enable (response_cache.py; not for sequences)
    batch_inputs: tuple = ()  # ((kind, target, dtype, source input), ...): ragged.py
    batch_outputs: tuple = ()  # ((kind, targets, source input), ...): ragged.py
    decoupled: bool = False  # model_transaction_policy.decoupled: 0..n responses per request

    def device(self, instance: int) -> int:
        return self.devices[instance] if self.devices else devices.CPU

    @property
    def device_memory(self) -> bool:
        """Whether callers may send tensors in device memory (CUDA IPC, gpu/ipc.py):
        every instance is a pytorch one on a GPU, and nothing on the model's path reads
        tensor bytes on the host (response cache, ragged and batch inputs, BYTES,
        sequences, decoupled responses)."""
        return (self.backend == "pytorch" and bool(self.devices)
                and all(d != devices.CPU for d in self.devices)
                and not (self.response_cache or self.sequence or self.decoupled
                         or self.batch_inputs or self.batch_outputs)
                and not any(t.ragged for t in self.inputs)
                and all(t.dtype != DataType.BYTES for t in (*self.inputs, *self.outputs)))

    def extra_inputs(self) -> list[str]:
        """Tensors the server adds to the model's inputs beyond the config's `input`:
        sequence control inputs, correlation id, implicit state inputs, batch_input
        targets. A framework model has them as inputs of its graph, as in Triton."""
        names = [target for _, target, _, _ in self.batch_inputs]
        if self.sequence:
            names += [c[1] for c in self.sequence["controls"]]
            names += [self.sequence["corrid"][0]] if self.sequence["corrid"] else []
            names += [st[0] for st in self.sequence["states"]]
        return names

    def extra_outputs(self) -> list[str]:
        """Outputs the server takes from the model beyond the config's `output`: the
        implicit state outputs of a sequence model."""
        return [st[1] for st in self.sequence["states"]] if self.sequence else []

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        d = dict(d)
        d["inputs"] = tuple(_tensor_from_dict(t) for t in d["inputs"])
        d["outputs"] = tuple(_tensor_from_dict(t) for t in d["outputs"])
        d["preferred_batch_sizes"] = tuple(d["preferred_batch_sizes"])
        d["warmup"] = tuple(d.get("warmup", ()))
        d["priority_queue_policies"] = tuple(tuple(p) for p in d.get("priority_queue_policies", ()))
        d["devices"] = tuple(d.get("devices", ()))
        d["batch_inputs"] = tuple(tuple(b) for b in d.get("batch_inputs", ()))
        d["batch_outputs"] = tuple((k, tuple(t), s) for k, t, s in d.get("batch_outputs", ()))
        return cls(**d)

    @property
    def model_dir(self) -> Path:
        version_dir = Path(self.path) if self.backend == ensemble.PLATFORM else Path(self.path).parent
        return version_dir.parent

    def config(self) -> mc.ModelConfig:
        """The model's configuration as served (completed and checked)."""
        return text_format.Parse(self.config_text, mc.ModelConfig())

    def labels(self, output: str) -> list[str]:
        """The labels of an output that names a label_filename (one per line, as
        Triton reads them); [] when it names none."""
        for t in self.outputs:
            if t.name == output:
                if not t.label_filename:
                    return []
                return (self.model_dir / t.label_filename).read_text().splitlines()
        raise KeyError(f"model '{self.name}' has no output '{output}'")

    def metadata(self, model_id: int) -> dict:
        """KServe-v2-style metadata, plus what a shared-memory client needs."""
        batch = [-1] if self.max_batch_size > 0 else []
        return {
            "id": model_id,
            "name": self.name,
            "version": self.version,
            "platform": self.backend,
            "max_batch_size": self.max_batch_size,
            "decoupled": self.decoupled,
            "inputs": [{"name": t.name, "datatype": t.dtype_name, "shape": batch + list(t.dims)}
                       for t in self.inputs],
            "outputs": [{"name": t.name, "datatype": t.dtype_name, "shape": batch + list(t.dims)}
                        for t in self.outputs],
        }


def _flag(params: dict, key: str, default: bool, where: str) -> bool:
    """A "true"/"false" model parameter of shmserve's."""
    text = params.get(key, str(default)).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f'{where}: parameters "{key}" must be "true" or "false", '
                          f"got {params[key]!r}")
    return text == "true"

def _tensor_from_dict(t: dict) -> TensorSpec:
    t = dict(t)
    t["dims"] = tuple(t["dims"])
    if t.get("reshape") is not None:
        t["reshape"] = tuple(t["reshape"])
    return TensorSpec(**t)


def parse_config(text: str, where: str) -> mc.ModelConfig:
    """Parses config.pbtxt text; errors name the file, line and column."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        pos = f":{line}:{col}" if line else ""
        raise ConfigError(f"{where}{pos}: {str(e).split(' : ', 1)[-1]}") from None


def parse_config_json(text: str, where: str) -> mc.ModelConfig:
    """A model configuration given as JSON (Triton's load API `config` parameter)."""
    from google.protobuf import json_format

    try:
        return json_format.Parse(text, mc.ModelConfig())
    except json_format.ParseError as e:
        raise ConfigError(f"{where}: not a model configuration in JSON: {e}") from None


def model_fingerprint(model_dir: Path) -> tuple:
    """What poll mode compares to see that a model changed: every file under its
    directory (config.pbtxt, labels, version directories and their files) by path,
    size and modification time. A model whose directory cannot be read has ()."""
    try:
        return tuple(sorted((str(p.relative_to(model_dir)), st.st_size, st.st_mtime_ns)
                            for p in model_dir.rglob("*")
                            if "__pycache__" not in p.parts and p.is_file()
                            for st in (p.stat(),)))
    except OSError:
        return ()


def _tensors(items, where: str, kind: str, batched: bool, model_dir: Path
             ) -> tuple[TensorSpec, ...]:
    if len(items) > MAX_TENSORS:
        raise ConfigError(f"{where}: {len(items)} {kind}s (limit {MAX_TENSORS})")
    out, seen = [], set()
    for t in items:
        if not t.name or len(t.name.encode()) >= NAME_BYTES:
            raise ConfigError(f"{where}: {kind} name {t.name!r} must be 1..{NAME_BYTES - 1} bytes")
        if t.name in seen:
            raise ConfigError(f"{where}: {kind} '{t.name}' declared twice")
        seen.add(t.name)
        type_name = mc.DataType.Name(t.data_type)
        code = DTYPE_CODES.get(type_name.removeprefix("TYPE_").replace("STRING", "BYTES"))
        if code is None:
            raise ConfigError(f"{where}: {kind} '{t.name}' has unsupported data_type {type_name}")
        dims = tuple(int(d) for d in t.dims)
        if len(dims) + batched > MAX_DIMS:
            raise ConfigError(f"{where}: {kind} '{t.name}' has {len(dims)} dims (limit {MAX_DIMS - batched}"
                              + (" plus the batch dimension)" if batched else ")"))
        if any(d < -1 or d == 0 for d in dims):
            raise ConfigError(f"{where}: {kind} '{t.name}' dims {list(dims)}: each must be -1 or > 0")
        shape = None
        if t.HasField("reshape"):
            shape = tuple(int(d) for d in t.reshape.shape)
            why = reshape.check(dims, shape)
            if why:
                raise ConfigError(f"{where}: {kind} '{t.name}' {why}")
        optional = kind == "input" and t.optional
        labels = t.label_filename if kind == "output" else ""
        if labels:
            path = model_dir / labels
            if not path.resolve().is_relative_to(model_dir.resolve()) or not path.is_file():
                raise ConfigError(f"{where}: output '{t.name}' label_filename {labels!r}: no such "
                                  f"file in {model_dir}")
        out.append(TensorSpec(t.name, code, dims, shape, optional, labels,
                              kind == "input" and t.allow_ragged_batch))
    if not out:
        raise ConfigError(f"{where}: the model declares no {kind}")
    return tuple(out)


def _versions(model_dir: Path, cfg: mc.ModelConfig, where: str) -> list[int]:
    """The versions Triton would load: of the version directories (a number not
    starting with 0), the highest `latest { num_versions }` (default 1), `all`, or
    the `specific { versions }` that exist (one that does not is logged as an error
    naming it, and the others load, as Triton does)."""
    available = sorted(int(p.name) for p in model_dir.iterdir()
                       if p.is_dir() and _VERSION_RE.match(p.name))
    if not available:
        raise ConfigError(f"{where}: no version directory in {model_dir} (a model's files go "
                          "in <model>/<version>/, the version a number such as 1)")
    policy = cfg.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return available
    if which == "specific":
        wanted = sorted(set(policy.specific.versions))
        for v in wanted:
            if v not in available:
                log.error("%s: version_policy specific names version %d, but %s/%d does not "
                          "exist (versions present: %s)", where, v, model_dir, v,
                          ", ".join(map(str, available)))
        chosen = [v for v in wanted if v in available]
        if not chosen:
            raise ConfigError(f"{where}: version_policy specific names versions "
                              f"{', '.join(map(str, wanted)) or '(none)'}, none of which exists "
                              f"in {model_dir} (versions present: "
                              f"{', '.join(map(str, available))})")
        return chosen
    n = policy.latest.num_versions if which == "latest" and policy.latest.num_versions else 1
    return available[-n:]


def resolve_backend(cfg: mc.ModelConfig, where: str) -> str:
    """The backend of a config naming its backend, its platform or both (then they
    must agree)."""
    by_platform = _PLATFORM_TO_BACKEND.get(cfg.platform)
    if cfg.platform and by_platform is None:
        raise ConfigError(f"{where}: platform '{cfg.platform}' is not supported (supported: "
                          f"{', '.join(sorted(_PLATFORM_TO_BACKEND))})")
    if cfg.backend and cfg.backend not in BACKENDS:
        raise ConfigError(f"{where}: backend '{cfg.backend}' is not supported "
                          f"(supported: {', '.join(sorted(BACKENDS))})")
    if cfg.backend and by_platform and cfg.backend != by_platform:
        raise ConfigError(f"{where}: platform '{cfg.platform}' and backend '{cfg.backend}' "
                          f"disagree (platform '{cfg.platform}' is the '{by_platform}' backend's; "
                          "name one of them, or both alike)")
    backend = cfg.backend or by_platform
    if not backend:
        raise ConfigError(f"{where}: names neither a backend nor a platform (backends: "
                          f"{', '.join(sorted(BACKENDS))})")
    return backend


def load_model(model_dir: Path, auto_complete: bool = True,
               problems: list | None = None, config_override: str | None = None
               ) -> list[ModelSpec]:
    """The servable versions of one model directory. auto_complete (Triton's default;
    --disable-auto-complete-config turns it off): an ONNX model's config.pbtxt may be
    missing or leave out input/output/max_batch_size, completed from the graph; a
    python model's is completed by its auto_complete_config hook (autocomplete.py).
    A version the policy selects whose model file is missing cannot be served: with
    `problems` (a list) it is appended there as a ModelProblem and the other versions
    are returned; without, it raises. config_override: the model configuration as
    JSON (Triton's load API `config` parameter), used instead of config.pbtxt."""
    where = str(model_dir / "config.pbtxt")
    model_path = None  # the file auto-complete reads, when found without a config
    if config_override is not None:
        where = f"model '{model_dir.name}': the load request's config"
        cfg = parse_config_json(config_override, where)
    elif (model_dir / "config.pbtxt").is_file():
        text = (model_dir / "config.pbtxt").read_text()
        cfg = parse_config(text, where)
    elif not auto_complete:
        raise ConfigError(f"{where}: missing (every model needs a config.pbtxt when "
                          "auto-complete is disabled)")
    else:
        for backend, model_file in ((autocomplete.ONNX_BACKEND, autocomplete.ONNX_FILE),
                                    (autocomplete.PYTHON_BACKEND, autocomplete.PYTHON_FILE)):
            model_path = autocomplete.find_model_file(model_dir, model_file)
            if model_path is not None:
                break
        else:
            raise ConfigError(f"{where}: missing, and no <version>/{autocomplete.ONNX_FILE} or "
                              f"<version>/{autocomplete.PYTHON_FILE} in {model_dir} to complete "
                              "a configuration from (only ONNX and python models are "
                              "auto-completed; others need a config.pbtxt)")
        where = str(model_dir)  # errors name the directory: there is no file
        cfg = mc.ModelConfig(backend=backend)
    name = cfg.name or model_dir.name
    if name != model_dir.name:
        raise ConfigError(f"{where}: name '{cfg.name}' differs from its directory '{model_dir.name}'")
    if not _NAME_RE.match(name) or len(name.encode()) >= NAME_BYTES:
        raise ConfigError(f"{where}: model name {name!r} must be letters, digits, '_.-', "
                          f"under {NAME_BYTES} bytes")
    cfg.name = name
    backend = resolve_backend(cfg, where)
    if cfg.model_transaction_policy.decoupled and backend != "python":
        raise ConfigError(f"{where}: model_transaction_policy decoupled is implemented by "
                          f"shmserve for python models only; this one is a {backend} model")
    if auto_complete and backend in (autocomplete.ONNX_BACKEND, autocomplete.PYTHON_BACKEND):
        if model_path is None:
            model_file = _model_file(cfg, backend, where)
            model_path = next((model_dir / str(v) / model_file
                               for v in reversed(_versions(model_dir, cfg, where))
                               if (model_dir / str(v) / model_file).is_file()), None)
        # No version holds the model file: nothing to complete from; each selected
        # version is then reported missing its file (below), as Triton fails its load.
        if model_path is not None and backend == autocomplete.ONNX_BACKEND:
            autocomplete.complete_onnx_config(cfg, model_path, where)
        elif model_path is not None:
            autocomplete.complete_python_config(cfg, model_path, where)
    unsupported.check(cfg, where, backend)  # refuses what changes results, warns of the rest
    backends.check_config(backend, cfg, where)  # the backend's own parameters and options
    if cfg.max_batch_size < 0:
        raise ConfigError(f"{where}: max_batch_size {cfg.max_batch_size} must be >= 0")
    batched = cfg.max_batch_size > 0
    inputs = _tensors(cfg.input, where, "input", batched, model_dir)
    outputs = _tensors(cfg.output, where, "output", batched, model_dir)
    if cfg.HasField("ensemble_scheduling") and backend != ensemble.PLATFORM:
        raise ConfigError(f"{where}: ensemble_scheduling belongs to platform \"ensemble\" "
                          f"models; this one is a {backend} model")
    if backend == ensemble.PLATFORM:
        instance_devices = _ensemble_instances(cfg, where)
    else:
        instance_devices = devices.instance_devices(cfg, backend, where)
    dyn = cfg.HasField("dynamic_batching") or (backend == ensemble.PLATFORM and batched)
    preferred = tuple(sorted(int(p) for p in cfg.dynamic_batching.preferred_batch_size))
    if any(p < 1 or p > max(cfg.max_batch_size, 1) for p in preferred):
        raise ConfigError(f"{where}: preferred_batch_size {list(preferred)} must lie in "
                          f"1..max_batch_size ({cfg.max_batch_size})")
    if dyn and not batched:
        raise ConfigError(f"{where}: dynamic_batching needs max_batch_size > 0")
    model_file = _model_file(cfg, backend, where)
    samples = warmup.parse(cfg, model_dir, where, inputs)
    sequence = sequence_config.parse(cfg, model_dir, where)
    batch_inputs, batch_outputs = ragged.parse(cfg, where)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    retry = _flag(params, RETRY_PARAMETER, False, where)
    overlap = _flag(params, OVERLAP_PARAMETER, False, where)
    balancing = params.get(BALANCING_PARAMETER, BALANCED).strip().lower()
    if balancing not in (BALANCED, GREEDY):
        raise ConfigError(f'{where}: parameters "{BALANCING_PARAMETER}" must be "{BALANCED}" or '
                          f'"{GREEDY}", got {params[BALANCING_PARAMETER]!r}')
    per_client = None
    if PER_CLIENT_PARAMETER in params:
        text = params[PER_CLIENT_PARAMETER].strip()
        if not text.isdigit():
            raise ConfigError(f'{where}: parameters "{PER_CLIENT_PARAMETER}" must be a whole number '
                              f"(0: no limit), got {params[PER_CLIENT_PARAMETER]!r}")
        per_client = int(text)
    dynb = cfg.dynamic_batching
    policy = dynb.default_queue_policy
    levels, default_level = int(dynb.priority_levels), int(dynb.default_priority_level)
    if levels and not 1 <= default_level <= levels:
        raise ConfigError(f"{where}: dynamic_batching default_priority_level {default_level} must "
                          f"lie in 1..priority_levels ({levels})")
    if not levels and default_level:
        raise ConfigError(f"{where}: dynamic_batching default_priority_level needs priority_levels")
    for level in dynb.priority_queue_policy:
        if not 1 <= level <= levels:
            raise ConfigError(f"{where}: dynamic_batching priority_queue_policy key {level} must lie "
                              f"in 1..priority_levels ({levels})")
    level_policies = tuple(
        (int(level), int(p.max_queue_size), int(p.default_timeout_microseconds),
         p.timeout_action == mc.ModelQueuePolicy.DELAY, bool(p.allow_timeout_override))
        for level, p in sorted(dynb.priority_queue_policy.items()))
    specs = []
    for v in _versions(model_dir, cfg, where):
        path = model_dir / str(v) / model_file
        if not path.exists():  # Triton fails this version's load; the others serve
            why = f"{path}: missing (the model file of version {v}, which version_policy selects)"
            if problems is None:
                raise ConfigError(why)
            problems.append(ModelProblem(name, v, why))
            continue
        specs.append(ModelSpec(
            name=name, version=v, backend=backend, path=str(path),
            max_batch_size=int(cfg.max_batch_size), inputs=inputs, outputs=outputs,
            instance_count=len(instance_devices), devices=instance_devices,
            dynamic_batching=dyn, preferred_batch_sizes=preferred,
            max_queue_delay_us=int(cfg.dynamic_batching.max_queue_delay_microseconds),
            parameters=params, config_text=text_format.MessageToString(cfg),
            retry_on_worker_crash=retry, max_queue_size=int(policy.max_queue_size),
            queue_timeout_us=int(policy.default_timeout_microseconds),
            queue_delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
            allow_timeout_override=bool(policy.allow_timeout_override),
            priority_levels=levels, default_priority_level=default_level,
            priority_queue_policies=level_policies, preserve_ordering=bool(dynb.preserve_ordering),
            instance_balancing=balancing, overlap=overlap, max_queued_per_client=per_client, warmup=samples, sequence=sequence,
            response_cache=(cfg.response_cache.enable and sequence is None
                            and backend != ensemble.PLATFORM),
            batch_inputs=batch_inputs, batch_outputs=batch_outputs,
            decoupled=bool(cfg.model_transaction_policy.decoupled)))
    return specs


def _ensemble_instances(cfg: mc.ModelConfig, where: str) -> tuple[int, ...]:
    """An ensemble's workers, all on the CPU: each runs one batch's steps at a time."""
    if cfg.instance_group:
        raise ConfigError(f'{where}: an ensemble takes no instance_group (it runs no model '
                          f'itself; parameters "{ensemble.INSTANCES_PARAMETER}" sets how many '
                          "of its batches run at once)")
    value = cfg.parameters[ensemble.INSTANCES_PARAMETER].string_value \
        if ensemble.INSTANCES_PARAMETER in cfg.parameters else str(ensemble.DEFAULT_INSTANCES)
    if not value.strip().isdigit() or not 1 <= int(value) <= 64:
        raise ConfigError(f'{where}: parameters "{ensemble.INSTANCES_PARAMETER}" must be a whole '
                          f"number from 1 to 64, got {value!r}")
    return (devices.CPU,) * int(value)


def _model_file(cfg: mc.ModelConfig, backend: str, where: str) -> str:
    """The model file's name in each version directory: default_model_filename, or
    the backend's default (model.onnx, model.pt, model.plan, model.py)."""
    if backend == ensemble.PLATFORM:
        return ""
    model_file = cfg.default_model_filename or BACKENDS[backend][1]
    if os.sep in model_file or model_file in ("..", "."):
        raise ConfigError(f"{where}: default_model_filename {model_file!r} must be a file name")
    return model_file


@dataclasses.dataclass(frozen=True)
class ModelProblem:
    """A model of the repository that cannot be served: its directory name, the
    version concerned (None: the whole model) and why (ConfigError's message, naming
    the file)."""
    name: str
    version: int | None
    reason: str

    @property
    def state(self) -> str:
        return f"UNAVAILABLE: {self.reason}"


def scan_repository(path: str | os.PathLike, auto_complete: bool = True
                    ) -> tuple[list[ModelSpec], list[ModelProblem]]:
    """Every servable (model, version) of the repository, sorted by name then version,
    and every model that cannot be served with the reason: one broken model hides
    neither the others nor their problems. Raises ConfigError only for the repository
    itself (not a directory, no model directory at all). auto_complete: load_model."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a directory")
    specs: list[ModelSpec] = []
    problems: list[ModelProblem] = []
    model_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for model_dir in model_dirs:
        try:
            specs.extend(load_model(model_dir, auto_complete, problems))
        except ConfigError as e:
            problems.append(ModelProblem(model_dir.name, None, e.msg))
        except (OSError, UnicodeDecodeError) as e:  # unreadable config.pbtxt or version dir
            problems.append(ModelProblem(model_dir.name, None, f"{model_dir}: {e}"))
    if not model_dirs:
        raise ConfigError(f"model repository {root} holds no model")
    return ensemble.check_all(specs, problems, ModelProblem), problems


def problems_message(problems: list[ModelProblem]) -> str:
    """One problem: its reason as ConfigError words it; several: each, named."""
    if len(problems) == 1:
        return problems[0].reason
    return (f"{len(problems)} models cannot be loaded ("
            + ", ".join(f"'{p.name}'" for p in problems)
            + "; --exit-on-error=false serves the others):\n"
            + "\n".join(f"  model '{p.name}': {p.reason}" for p in problems))


def load_repository(path: str | os.PathLike, auto_complete: bool = True) -> list[ModelSpec]:
    """Every servable (model, version) of the repository, sorted by name then version;
    ConfigError naming every broken model if any is (scan_repository tolerates them)."""
    specs, problems = scan_repository(path, auto_complete)
    if problems:
        raise ConfigError(problems_message(problems))
    return specs
