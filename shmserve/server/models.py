"""The model table's life cycle, the coordinator's alone: which model version each
entry of the server segment's model table holds, under which handle, in which state,
with which instance workers (mailboxes); which models could not be loaded and why.

Capacity is reserved at start (`--model-table-size` entries, `--max-model-instances`
mailboxes) because the server segment never grows. A request names its model by a
handle, index | generation << 16 (SHMS_MODEL_HANDLE): an entry's generation is bumped
whenever it stops naming what it named (unload, reload) and when it is given to
another model, so a handle resolved before is refused by the batcher, never served by
another model or layout (docs/protocol.md, "Model handles").

States, as Triton's repository index words them: LOADING (its workers load), READY,
UNLOADING (no new request; those it holds drain), UNAVAILABLE: <reason>.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path, PurePosixPath

from .. import protocol as P
from ..errors import ConfigError, ShmServeError, UnavailableError
from . import ensemble
from .repository import _NAME_RE, ModelProblem, ModelSpec, load_model, model_fingerprint

log = logging.getLogger("shmserve.coordinator")

INDEX_BITS = 16
INDEX_MASK = (1 << INDEX_BITS) - 1
MAX_ENTRIES = INDEX_MASK  # an index fits below the generation bits
LOADING, READY, UNLOADING = "LOADING", "READY", "UNLOADING"
DRAINED = 2  # model.ready as the batcher leaves it once an UNLOADING entry holds nothing


def handle(index: int, generation: int) -> int:
    return ((generation & 0xFFFF) << INDEX_BITS) | index


def version_fingerprint(spec: ModelSpec) -> tuple:
    """What a reload compares: the spec as served (config included) and the files of
    its version directory and of the model directory outside version directories
    (config.pbtxt, labels, warmup data)."""
    model_dir = spec.model_dir
    version_dir = model_dir / str(spec.version)
    shared = tuple(f for f in model_fingerprint(model_dir)
                   if not f[0].split("/", 1)[0].isdigit())
    return (json.dumps(spec.to_dict(), sort_keys=True, default=str),
            model_fingerprint(version_dir), shared)


@dataclasses.dataclass(eq=False)
class Entry:
    index: int
    generation: int
    spec: ModelSpec
    fingerprint: tuple
    workers: list  # supervisor.Child of each instance
    mailboxes: list[int]  # their worker indexes
    state: str = LOADING
    loaded_s: float = 0.0
    withdrawn_as: str = ""  # unloading: what a request naming its handle is told

    @property
    def handle(self) -> int:
        return handle(self.index, self.generation)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def version(self) -> int:
        return self.spec.version


class ModelTable:
    def __init__(self, capacity: int, max_instances: int):
        if not 1 <= capacity <= MAX_ENTRIES:
            raise ValueError(f"model table size {capacity} must be 1..{MAX_ENTRIES}")
        self.capacity, self.max_instances = capacity, max_instances
        self.entries: list[Entry | None] = [None] * capacity
        self.generations = [0] * capacity  # the last generation each index was given
        self.used = [False] * capacity  # an index given once: its next owner bumps it
        self.free_mailboxes = list(range(max_instances))
        # Models (or versions: problem.version) that could not be loaded, by name;
        # listed UNAVAILABLE with the reason until loaded or unloaded.
        self.problems: dict[str, list[ModelProblem]] = {}
        self.unloaded: set[str] = set()  # unloaded while serving: UNAVAILABLE "unloaded"
        self.trace_names: dict[int, tuple[str, int]] = {}  # index -> (name, version), tracing

    # -- entries -----------------------------------------------------------------
    def add(self, spec: ModelSpec, fingerprint: tuple = ()) -> Entry:
        """A free entry and mailboxes for one model version, LOADING; raises BUSY
        naming the flag when the table or the mailboxes are full."""
        try:
            index = self.entries.index(None)
        except ValueError:
            raise ShmServeError(
                f"model '{spec.name}' version {spec.version}: the model table is full "
                f"({self.capacity} model versions; start the server with a larger "
                "--model-table-size)", P.Status.BUSY) from None
        if spec.instance_count > len(self.free_mailboxes):
            raise ShmServeError(
                f"model '{spec.name}' version {spec.version}: {spec.instance_count} instance(s) "
                f"wanted, {len(self.free_mailboxes)} of {self.max_instances} free (start the "
                "server with a larger --max-model-instances)", P.Status.BUSY)
        if self.used[index]:
            self.generations[index] = (self.generations[index] + 1) & 0xFFFF
        self.used[index] = True
        mailboxes = [self.free_mailboxes.pop(0) for _ in range(spec.instance_count)]
        entry = Entry(index, self.generations[index], spec, fingerprint, [], mailboxes)
        self.entries[index] = entry
        self.trace_names[index] = (spec.name, spec.version)
        self.unloaded.discard(spec.name)
        return entry

    def withdraw(self, entry: Entry) -> int:
        """The entry stops naming its model: a new generation, which the caller
        writes to the segment. The entry stays until release()."""
        self.generations[entry.index] = (self.generations[entry.index] + 1) & 0xFFFF
        return self.generations[entry.index]

    def release(self, entry: Entry) -> None:
        """Frees the entry and its mailboxes (its workers have exited)."""
        if self.entries[entry.index] is entry:
            self.entries[entry.index] = None
        self.free_mailboxes = sorted(self.free_mailboxes + entry.mailboxes)

    def all(self) -> list[Entry]:
        return sorted((e for e in self.entries if e is not None),
                      key=lambda e: (e.name, e.version, e.state == UNLOADING))

    def of(self, name: str) -> list[Entry]:
        return [e for e in self.all() if e.name == name]

    def served(self) -> list[Entry]:
        """The entry each (name, version) resolves to: never an UNLOADING one; of a
        READY one and one that replaces it (LOADING), the READY one."""
        best: dict[tuple[str, int], Entry] = {}
        for e in self.all():
            if e.state == UNLOADING:
                continue
            key = (e.name, e.version)
            if key not in best or (best[key].state != READY and e.state == READY):
                best[key] = e
        return sorted(best.values(), key=lambda e: (e.name, e.version))

    def by_handle(self, h: int) -> Entry | None:
        index = h & INDEX_MASK
        e = self.entries[index] if 0 <= index < self.capacity else None
        return e if e is not None and e.handle == h else None

    # -- problems -----------------------------------------------------------------
    def set_problems(self, name: str, problems: list[ModelProblem]) -> None:
        if problems:
            self.problems[name] = problems
        else:
            self.problems.pop(name, None)

    def all_problems(self) -> list[ModelProblem]:
        return [p for name in sorted(self.problems) for p in self.problems[name]]

    # -- Triton's repository index ------------------------------------------------------
    def index(self, repository: Path, ready_only: bool = False) -> list[dict]:
        """Every model of the repository and every model served: its versions, their
        state and reason. A model never loaded has neither version nor state (as
        Triton); one unloaded is UNAVAILABLE, reason "unloaded"."""
        rows: dict[tuple[str, str], dict] = {}
        for e in self.all():
            reason = e.state.split(": ", 1)[1] if e.state.startswith("UNAVAILABLE") else ""
            state = "UNAVAILABLE" if reason else e.state
            key = (e.name, str(e.version))
            if key in rows and rows[key]["state"] == READY:
                continue  # the READY one of a reload in progress
            rows[key] = {"name": e.name, "version": str(e.version), "state": state,
                         "reason": reason}
        for p in self.all_problems():
            key = (p.name, "" if p.version is None else str(p.version))
            rows.setdefault(key, {"name": p.name, "version": key[1], "state": "UNAVAILABLE",
                                  "reason": p.reason})
        named = {name for name, _ in rows}
        for name in sorted(self.unloaded - named):
            rows[(name, "")] = {"name": name, "version": "", "state": "UNAVAILABLE",
                                "reason": "unloaded"}
            named.add(name)
        try:
            dirs = [p.name for p in Path(repository).iterdir()
                    if p.is_dir() and not p.name.startswith(".")]
        except OSError:
            dirs = []
        for name in dirs:
            if name not in named:
                rows[(name, "")] = {"name": name, "version": "", "state": "", "reason": ""}
        out = sorted(rows.values(), key=lambda r: (r["name"], int(r["version"] or 0)))
        if ready_only:
            out = [r for r in out if r["state"] == READY]
        return out


class ModelControl:
    """Loading and unloading while serving (--model-control-mode explicit and poll):
    a mixin of Coordinator, whose state it uses (self.table, the segments, the
    children). One operation at a time (self.table_lock), as Triton serializes them."""

    # -- the batcher's view of the table ---------------------------------------------
    def batcher_models(self) -> list[dict]:
        """The table as a (re)starting batcher boots with it."""
        return [{"model_id": e.index, "handle": e.handle, "spec": e.spec.to_dict(),
                 "workers": e.mailboxes, "draining": e.state == UNLOADING,
                 "stale": {str(e.handle): e.withdrawn_as} if e.withdrawn_as else {}}
                for e in self.table.all()]

    def tell_batcher(self, message: dict) -> None:
        """One change of the table, on the batcher's table pipe; then the epoch it
        compares once a loop, and its doorbell. A dead batcher's pipe is no error:
        its successor boots with the table as it is then."""
        from ..protocol import LAYOUT as L

        self.table_epoch += 1
        message["epoch"] = self.table_epoch
        if self.table_pipe is not None:
            try:
                os.write(self.table_pipe, (json.dumps(message) + "\n").encode())
            except OSError:
                pass
        self.server.ops.store32(L["server.table_epoch"], self.table_epoch)
        self.control.ops.ring_batcher(self.bell.ops)

    def write_model_entry(self, index: int, spec: ModelSpec, generation: int = 0) -> None:
        """Entry `index` of the segment's table for `spec`, not ready, its statistics
        zeroed (an index reused), then its generation: handles of that generation are
        valid from here (the model is not ready yet)."""
        from ..protocol import LAYOUT as L

        off = self.layout.model(index)
        srv = self.server.ops
        srv.store32(off + L["model.ready"], 0)
        srv.put(off + L["model.stats"], bytes(L["model_stats.size"]))
        srv.write_model_entry(
            off, spec.name, spec.version, spec.max_batch_size,
            [(t.name, t.dtype, t.dims) for t in spec.inputs],
            [(t.name, t.dtype, t.dims) for t in spec.outputs],
            sum(1 << k for k, t in enumerate(spec.inputs) if t.optional),
            sum(1 << k for k, t in enumerate(spec.inputs) if t.ragged), int(spec.device_memory))
        srv.store32(off + L["model.generation"], generation)

    def cache_share(self, spec) -> int:
        """Each instance's bytes of --cache-config's budget: an equal share among the
        instances of the models served with response_cache (this one included)."""
        if not spec.response_cache:
            return 0
        if not self.opts.cache_bytes:
            log.warning("model '%s': response_cache is enabled but the server has no cache "
                        "(--cache-config local,size=BYTES): its requests are not cached", spec.name)
            return 0
        others = sum(e.spec.instance_count for e in self.table.served()
                     if e.spec.response_cache and e.spec is not spec)
        return self.opts.cache_bytes // (others + spec.instance_count)

    def worker_children(self, entry: Entry) -> list:
        from . import devices
        from .supervisor import Child

        trace = {} if self.traces is None else {"trace": self.traces.worker_boot()}
        spec = entry.spec
        cache_bytes = self.cache_share(spec)
        for instance, mailbox in enumerate(entry.mailboxes):
            device = spec.device(instance)
            child = Child("worker", self.boot_message(
                worker_index=mailbox, model_id=entry.index, instance=instance, device=device,
                cuda_pool_bytes=self.opts.cuda_pools.get(device, 0), model=spec.to_dict(),
                cache_bytes=cache_bytes, **trace), env=devices.worker_environment(spec.backend, device), entry=entry)
            entry.workers.append(child)
            self.children.append(child)
        return entry.workers

    # -- load ------------------------------------------------------------------------------
    def check_model_control(self) -> None:
        if self.opts.model_control_mode != "explicit":
            raise UnavailableError(P.MODEL_CONTROL_DISABLED)

    async def load_op(self, name: str, config: str | None, files: dict | None = None) -> None:
        self.check_model_control()
        async with self.table_lock:
            model_dir = self.write_model_files(name, config, files) if files else None
            try:
                await self.load_named(name, config, model_dir)
            finally:
                self.drop_unused_model_files()

    # Triton's load with "file:<path>" parameters: the model's directory is made of the
    # files the request carries (and its config), not taken from the repository. Each
    # such load gets a private directory beside the control socket, kept while a table
    # entry loads its workers from it (a restarted worker reads it again).
    @property
    def model_files_root(self) -> Path:
        return self.sock_path.parent / f"{self.opts.name}.models"

    def write_model_files(self, name: str, config: str | None, files: dict) -> Path:
        where = f"failed to load '{name}'"
        if config is None:
            raise ShmServeError(f"{where}: model files (file:<path> parameters) need the "
                                "'config' parameter too, as Triton's", P.Status.INVALID_ARG)
        if not _NAME_RE.match(name):
            raise ShmServeError(f"{where}: not a model name", P.Status.INVALID_ARG)
        checked = []
        for path, data in files.items():
            parts = PurePosixPath(path).parts if isinstance(path, str) else ()
            if (not parts or path.startswith("/") or "\0" in path
                    or any(p in ("..", ".") for p in parts)):
                raise ShmServeError(f"{where}: model file 'file:{path}' must name a path "
                                    "inside the model directory (e.g. file:1/model.onnx)",
                                    P.Status.INVALID_ARG)
            if not isinstance(data, bytes):
                raise ShmServeError(f"{where}: model file 'file:{path}' must be bytes",
                                    P.Status.INVALID_ARG)
            checked.append((parts, data))
        self.model_files_root.mkdir(mode=0o700, exist_ok=True)
        model_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.model_files_root)) / name
        for parts, data in checked:
            target = model_dir.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return model_dir

    def drop_unused_model_files(self) -> None:
        """Removes the directories of file loads that no table entry uses any more."""
        root = self.model_files_root
        if not root.is_dir():
            return
        used = {Path(e.spec.path).resolve() for e in self.table.all()}
        for d in root.iterdir():
            if not any(d.resolve() in p.parents for p in used):
                shutil.rmtree(d, ignore_errors=True)

    async def load_named(self, name: str, config: str | None = None,
                         model_dir: Path | None = None) -> None:
        """Loads model `name` from the repository, or from model_dir (files a load
        carried), or reloads it: versions that are
        new or changed load beside those serving, which keep serving until the new
        ones are READY and then drain; versions no longer selected unload. A version
        that fails to load leaves the one it would replace serving (Triton's reload).
        Raises INVALID_ARG naming each version that failed."""
        model_dir = model_dir or Path(self.opts.model_repository) / name
        if not _NAME_RE.match(name) or not model_dir.is_dir():
            raise ShmServeError(f"failed to load '{name}', failed to poll from model repository "
                                f"({model_dir} is not a model directory)", P.Status.NOT_FOUND)
        problems: list[ModelProblem] = []
        try:
            specs = load_model(model_dir, self.opts.auto_complete_config, problems, config)
        except ConfigError as e:
            specs, problems = [], [ModelProblem(name, None, e.msg)]
        except (OSError, UnicodeDecodeError) as e:
            specs, problems = [], [ModelProblem(name, None, f"{model_dir}: {e}")]
        if any(spec.backend == ensemble.PLATFORM for spec in specs):
            # an ensemble's steps are checked against the models served now (as at start)
            others = [e.spec for e in self.table.served() if e.name != name and e.state == READY]
            found: list[ModelProblem] = []
            specs = [s for s in ensemble.check_all(others + specs, found, ModelProblem)
                     if s.name == name]
            problems += [p for p in found if p.name == name]
        current = [e for e in self.table.of(name) if e.state != UNLOADING]
        serving = {e.version: e for e in current if e.state == READY}
        fresh, kept = [], set()
        for spec in specs:
            fp = version_fingerprint(spec)
            old = serving.get(spec.version)
            if old is not None and old.fingerprint == fp and config is None:
                kept.add(spec.version)
            else:
                fresh.append((spec, fp))
        added = []
        try:
            for spec, fp in fresh:
                added.append(self.table.add(spec, fp))
        except ShmServeError:
            for e in added:  # nothing started yet
                self.table.release(e)
            raise
        loaded = await self.start_entries(added)
        for e in loaded:
            if e.state == READY:
                log.info("model loaded: '%s' version %d, %d instance%s in %.2f s", e.name,
                         e.version, len(e.mailboxes), "s" * (len(e.mailboxes) != 1), e.loaded_s)
        failed = [e for e in loaded if e.state != READY]
        problems += [ModelProblem(e.name, e.version, e.state.split(": ", 1)[-1]) for e in failed]
        for p in problems:
            log.error("model failed to load: '%s'%s: %s", name,
                      "" if p.version is None else f" version {p.version}", p.reason)
        ready_versions = kept | {e.version for e in loaded if e.state == READY}
        whole_failed = any(p.version is None for p in problems)
        # Replaced (a new one READY), no longer selected, or broken: withdrawn. A version
        # whose reload failed keeps serving; so does every version if the model failed.
        retire = [e for e in current
                  if e.version in ready_versions and e.version not in kept
                  or (not whole_failed and e.version not in {s.version for s in specs}
                      and e.version not in {p.version for p in problems})
                  or (e.state != READY and e.version not in serving)]
        await self.release_entries(failed)
        await self.unload_entries(retire, reloaded=True)
        still = {e.version for e in self.table.of(name) if e.state == READY}
        self.table.set_problems(name, [p for p in problems if p.version not in still])
        if problems:
            raise ShmServeError(f"load failed for model '{name}': " + "; ".join(
                ("" if p.version is None else f"version {p.version}: ") + p.reason
                for p in problems), P.Status.INVALID_ARG)

    async def start_entries(self, entries: list[Entry]) -> list[Entry]:
        """Starts the workers of new entries and waits for their load reports (at most
        --load-timeout); each entry ends READY (published) or UNAVAILABLE: why."""
        from ..protocol import LAYOUT as L
        from .supervisor import describe_exit

        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + self.opts.load_timeout_s
        for e in entries:
            log.info("model loading: '%s' version %d (%s backend, %d instance%s, "
                     "max_batch_size %d)", e.name, e.version, e.spec.backend,
                     len(e.mailboxes), "s" * (len(e.mailboxes) != 1), e.spec.max_batch_size)
            self.write_model_entry(e.index, e.spec, e.generation)
            self.tell_batcher({"op": "add", "model_id": e.index, "handle": e.handle,
                               "spec": e.spec.to_dict(), "workers": e.mailboxes})
            for child in self.worker_children(e):
                self.spawn(child, handshake=True)
        for e in entries:
            reports = await asyncio.gather(*(
                loop.run_in_executor(None, self.read_handshake, c, deadline) for c in e.workers))
            why = None
            for child, msg in zip(e.workers, reports):
                child.handshake.close()
                child.handshake = None
                if not msg.get("ready") and why is None:
                    why = msg.get("error") or describe_exit(
                        await loop.run_in_executor(None, child.proc.wait))
                    why = f"instance {child.boot['instance']}: {why}"
                e.loaded_s = max(e.loaded_s, msg.get("monotonic", time.monotonic()) - started)
            if why is None:
                e.state = READY
                self.server.ops.store32(self.layout.model(e.index) + L["model.ready"], 1)
            else:
                e.state = f"UNAVAILABLE: {why}"
        return entries

    # -- unload ------------------------------------------------------------------------------
    async def unload_op(self, name: str, dependents: bool = False) -> None:
        """dependents: the ensembles calling the model are unloaded too, first (Triton's
        unload_dependents); else they stay and their requests fail naming the step."""
        self.check_model_control()
        async with self.table_lock:
            try:
                if dependents:
                    specs = [e.spec for e in self.table.all() if e.state != UNLOADING]
                    for caller in ensemble.dependents(specs, name):
                        log.info("model unloading: '%s' (an ensemble calling '%s')", caller, name)
                        await self.unload_named(caller)
                await self.unload_named(name)
            finally:
                self.drop_unused_model_files()

    async def unload_named(self, name: str) -> None:
        entries = [e for e in self.table.of(name) if e.state != UNLOADING]
        if not entries and name not in self.table.problems and name not in self.table.unloaded:
            if not (Path(self.opts.model_repository) / name).is_dir():
                raise ShmServeError(f"failed to unload '{name}': no such model (not loaded, "
                                    "not in the repository)", P.Status.NOT_FOUND)
        await self.unload_entries(entries, reloaded=False)
        self.table.set_problems(name, [])
        self.table.unloaded.add(name)

    async def unload_entries(self, entries: list[Entry], reloaded: bool) -> None:
        """Withdraws entries: their handles go stale at once (new requests refused,
        naming the model), the requests the batcher holds for them finish (at most
        --exit-timeout-secs), then their workers stop (finalize runs)."""
        from ..protocol import LAYOUT as L

        for e in entries:
            old = e.handle
            was = e.state
            e.state = UNLOADING
            self.server.ops.store32(self.layout.model(e.index) + L["model.generation"],
                                    self.table.withdraw(e))
            what = ("reloaded: resolve the model name again" if reloaded and was == READY
                    else "unloaded")
            e.withdrawn_as = (f"model '{e.name}' version {e.version} was {what} "
                              f"({P.STALE_MODEL_ID} {old:#x})")
            self.tell_batcher({"op": "drain", "model_id": e.index,
                               "stale": {str(old): e.withdrawn_as}})
            log.info("model unloading: '%s' version %d", e.name, e.version)
        deadline = time.monotonic() + self.opts.exit_timeout_s
        left = list(entries)
        while left and time.monotonic() < deadline:
            left = [e for e in left if self.server.ops.load32(
                self.layout.model(e.index) + L["model.ready"]) != DRAINED
                and any(c.proc is not None and c.proc.poll() is None for c in e.workers)]
            if left:
                await asyncio.sleep(0.005)
        for e in left:
            log.warning("model '%s' version %d: unloading with requests unanswered "
                        "(--exit-timeout-secs)", e.name, e.version)
        await self.release_entries(entries)
        for e in entries:
            log.info("model unloaded: '%s' version %d", e.name, e.version)

    async def release_entries(self, entries: list[Entry]) -> None:
        """Stops the entries' workers (SIGTERM: the batch in hand, then finalize),
        tells the batcher to forget them, clears their mailboxes and frees them."""
        from ..protocol import LAYOUT as L

        loop = asyncio.get_running_loop()
        workers = [c for e in entries for c in e.workers]
        for child in workers:
            child.retired = True  # never restarted from here on
            if child.proc is not None and child.proc.poll() is None:
                child.proc.terminate()
        await asyncio.gather(*(loop.run_in_executor(None, _reap, c) for c in workers))
        for e in entries:
            self.tell_batcher({"op": "drop", "model_id": e.index})
            self.server.ops.store32(self.layout.model(e.index) + L["model.ready"], 0)
            for mailbox in e.mailboxes:
                self.server.ops.put(self.layout.mailbox(mailbox), bytes(L["mailbox.size"]))
            self.children = [c for c in self.children if c.entry is not e]
            self.table.release(e)

    # -- poll mode ----------------------------------------------------------------------------
    def repository_fingerprints(self) -> dict[str, tuple]:
        root = Path(self.opts.model_repository)
        try:
            dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except OSError as e:
            log.error("model repository %s: cannot read it: %s", root, e)
            return dict(self.polled)
        return {p.name: model_fingerprint(p) for p in dirs}

    async def poll_repository(self, stop: asyncio.Event) -> None:
        """--model-control-mode poll: every --repository-poll-secs, loads the models
        that appeared or changed and unloads those whose directory went."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.opts.repository_poll_secs)
                return
            except asyncio.TimeoutError:
                pass
            async with self.table_lock:
                now = self.repository_fingerprints()
                for name in sorted(set(self.polled) | set(now)):
                    if stop.is_set():
                        return
                    if self.polled.get(name) == now.get(name):
                        continue
                    try:
                        if name in now:
                            log.info("repository poll: model '%s' %s", name,
                                     "changed" if name in self.polled else "appeared")
                            await self.load_named(name)
                        else:
                            log.info("repository poll: model '%s' was removed", name)
                            await self.unload_named(name)
                    except ShmServeError as e:
                        log.error("repository poll: %s", e.msg)
                self.polled = now


def _reap(child) -> None:
    """Waits for a stopping worker, at most 3 s before SIGKILL."""
    import subprocess

    if child.proc is None:
        return
    try:
        child.proc.wait(3)
    except subprocess.TimeoutExpired:
        child.proc.kill()
        child.proc.wait()
