"""Ensembles (platform "ensemble"): Triton's ensemble_scheduling, read and checked.

    ensemble_scheduling { step [
      { model_name: "pre"  model_version: -1
        input_map  { key: "RAW" value: "INPUT" }        # step input <- ensemble tensor
        output_map { key: "OUT" value: "features" } },  # step output -> ensemble tensor
      { model_name: "cls" input_map { key: "X" value: "features" }
        output_map { key: "Y" value: "OUTPUT" } } ] }

An ensemble is served by workers like any model (backends/ensemble_backend.py): each
batch of ensemble requests runs its steps as requests of the worker's own lease on
the server, each step as soon as its inputs exist, scheduled by its model's own
policy. Intermediate tensors are outputs in that lease's arena and go to the next
step in place (no copy). This module is the config side: the steps in a usable
form, the checks of the graph on its own (check_graph, at load) and against the
models it calls (check_steps, once the repository is read).
"""
from __future__ import annotations

import dataclasses

from ..model_config import mc

from ..errors import ConfigError

PLATFORM = "ensemble"
# How many batches of an ensemble run at once (each in a worker process of its own):
#   parameters { key: "shmserve.ensemble_instances" value { string_value: "4" } }
INSTANCES_PARAMETER = "shmserve.ensemble_instances"
DEFAULT_INSTANCES = 2


@dataclasses.dataclass(frozen=True)
class Step:
    index: int
    model: str
    version: int  # -1: the latest served (0 too, unset: no version directory is 0)
    inputs: tuple[tuple[str, str], ...]  # (the step model's input, ensemble tensor)
    outputs: tuple[tuple[str, str], ...]  # (the step model's output, ensemble tensor)

    def describe(self) -> str:
        version = "" if self.version < 0 else f" version {self.version}"
        return f"step {self.index} (model '{self.model}'{version})"


def steps_of(cfg: mc.ModelConfig) -> tuple[Step, ...]:
    return tuple(Step(i, s.model_name, max(int(s.model_version), 0) or -1,
                      tuple(sorted(s.input_map.items())),
                      tuple(sorted(s.output_map.items())))
                 for i, s in enumerate(cfg.ensemble_scheduling.step))


def dependents(specs, name: str) -> list[str]:
    """The ensembles among specs that call `name`, directly or through another
    ensemble (Triton's unload_dependents), callers before the ensembles they call."""
    calls = {s.name: {step.model for step in steps_of(s.config())}
             for s in specs if s.backend == PLATFORM}
    found: list[str] = []
    todo = [name]
    while todo:
        callee = todo.pop()
        for caller, callees in sorted(calls.items()):
            if callee in callees and caller not in found and caller != name:
                found.append(caller)
                todo.append(caller)
    return found[::-1]


def order(steps: tuple[Step, ...], inputs: set[str]) -> list[Step]:
    """The steps in an order where each finds its inputs made (ConfigError if none)."""
    have, left, out = set(inputs), list(steps), []
    while left:
        ready = [s for s in left if all(t in have for _, t in s.inputs)]
        if not ready:
            s = left[0]
            missing = sorted(t for _, t in s.inputs if t not in have)
            raise ConfigError(f"{s.describe()} needs ensemble tensor(s) {', '.join(missing)}, "
                              "which neither the ensemble's inputs nor an earlier step make "
                              "(or the steps form a cycle)")
        for s in ready:
            have.update(t for _, t in s.outputs)
            left.remove(s)
            out.append(s)
    return out


def check_graph(cfg: mc.ModelConfig, where: str) -> tuple[Step, ...]:
    """The ensemble's own checks, as Triton makes them: steps name models and map
    tensors, each ensemble tensor is made once, every step's inputs exist before it
    runs (no cycle), every ensemble output is made."""
    if not cfg.HasField("ensemble_scheduling") or not cfg.ensemble_scheduling.step:
        raise ConfigError(f"{where}: platform \"ensemble\" needs ensemble_scheduling with at "
                          "least one step")
    steps = steps_of(cfg)
    made = {t.name: "an ensemble input" for t in cfg.input}
    for s in steps:
        if not s.model:
            raise ConfigError(f"{where}: step {s.index} names no model_name")
        if s.model == cfg.name:
            raise ConfigError(f"{where}: {s.describe()} is the ensemble itself")
        if not s.inputs or not s.outputs:
            raise ConfigError(f"{where}: {s.describe()} needs an input_map and an output_map")
        for _, tensor in s.outputs:
            if tensor in made:
                raise ConfigError(f"{where}: ensemble tensor '{tensor}' is made twice: by "
                                  f"{made[tensor]} and by {s.describe()}")
            made[tensor] = s.describe()
    try:
        order(steps, {t.name for t in cfg.input})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.msg}") from None
    for t in cfg.output:
        if t.name not in made:
            raise ConfigError(f"{where}: ensemble output '{t.name}' is made by no step "
                              "(name it as a value of a step's output_map)")
    return steps


def _dims(spec, tensor) -> tuple[int, ...]:
    return ((-1,) if spec.max_batch_size > 0 else ()) + tuple(tensor.dims)


def _agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def check_steps(ensemble, by_name: dict[str, list]) -> None:
    """ConfigError unless every step's model is there and agrees with the ensemble:
    the mapped tensors exist, with the same data types and compatible shapes, every
    required input is mapped, and a batching ensemble's steps batch as much.
    `by_name`: model name -> its served specs."""
    where = f"ensemble '{ensemble.name}'"
    steps = steps_of(ensemble.config())
    ens_tensors = {t.name: (t.dtype, _dims(ensemble, t)) for t in ensemble.inputs}
    for s in order(steps, set(ens_tensors)):
        specs = by_name.get(s.model, [])
        spec = (max(specs, key=lambda x: x.version) if s.version < 0 and specs else
                next((x for x in specs if x.version == s.version), None))
        if spec is None:
            served = ", ".join(str(x.version) for x in specs)
            raise ConfigError(f"{where}: {s.describe()}: no such model is served"
                              + (f" (versions served: {served})" if served else ""))
        if ensemble.max_batch_size > spec.max_batch_size:
            raise ConfigError(f"{where}: max_batch_size {ensemble.max_batch_size} exceeds "
                              f"{s.describe()}'s {spec.max_batch_size} (an ensemble batches at "
                              "most as much as each of its models)")
        ins = {t.name: t for t in spec.inputs}
        outs = {t.name: t for t in spec.outputs}
        for name, tensor in s.inputs:
            if name not in ins:
                raise ConfigError(f"{where}: {s.describe()} input_map names input '{name}', "
                                  f"which the model does not have (inputs: {', '.join(ins)})")
            dtype, dims = ens_tensors[tensor]
            if dtype != ins[name].dtype:
                raise ConfigError(f"{where}: {s.describe()} input '{name}' is "
                                  f"{ins[name].dtype_name}, ensemble tensor '{tensor}' is "
                                  f"{_dtype_name(dtype)}")
            want = _dims(spec, ins[name])
            if ensemble.max_batch_size > 0 or spec.max_batch_size == 0:
                if not _agree(dims, want):
                    raise ConfigError(f"{where}: {s.describe()} input '{name}' has shape "
                                      f"{list(want)}, ensemble tensor '{tensor}' {list(dims)}")
        missing = [t.name for t in spec.inputs
                   if not t.optional and t.name not in dict(s.inputs)]
        if missing:
            raise ConfigError(f"{where}: {s.describe()} maps no ensemble tensor to input(s) "
                              f"{', '.join(missing)}")
        for name, tensor in s.outputs:
            if name not in outs:
                raise ConfigError(f"{where}: {s.describe()} output_map names output '{name}', "
                                  f"which the model does not have (outputs: {', '.join(outs)})")
            ens_tensors[tensor] = (outs[name].dtype, _dims(spec, outs[name]))
    for t in ensemble.outputs:
        dtype, _ = ens_tensors[t.name]
        if dtype != t.dtype:
            raise ConfigError(f"{where}: output '{t.name}' is {t.dtype_name} in its config, "
                              f"the step that makes it gives {_dtype_name(dtype)}")


def _dtype_name(code: int) -> str:
    from ..protocol import DTYPE_CODES

    return next(k for k, v in DTYPE_CODES.items() if v == code)


def check_all(specs: list, problems: list, problem_type) -> list:
    """The specs whose ensembles check out against the others; each ensemble that does
    not becomes a problem (UNAVAILABLE, with the reason), and so does an ensemble
    calling one that failed."""
    good = list(specs)
    while True:
        by_name: dict[str, list] = {}
        for s in good:
            by_name.setdefault(s.name, []).append(s)
        bad = []
        for s in good:
            if s.backend != PLATFORM:
                continue
            try:
                check_steps(s, by_name)
            except ConfigError as e:
                bad.append((s, e.msg))
        if not bad:
            return good
        for s, why in bad:
            problems.append(problem_type(s.name, s.version, why))
            good.remove(s)
