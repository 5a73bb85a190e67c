"""`shmserve validate DIR`: a model repository checked without serving it.

The checks a start makes are the repository's own (scan_repository: load_model,
unsupported.py, autocomplete.py), run here as `serve` runs them, their warnings
caught from the log. load_model stops at a model's first problem, so this module
adds the checks that list the rest, and those a start does not make: directories
that are not versions, a version directory without the model file, each tensor's
dims and data type against the ONNX graph, duplicate names. Each finding names its
file, the line where the text-format parser gives one or where the field it is
about is written, and a fix.

No segment is created and no process started, and no model code runs, except a
python model's auto_complete_config hook when auto-complete is on (a start runs it
too, in a process of its own): that is reported as an "info" finding.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import re
from pathlib import Path

from google.protobuf import descriptor_pool
from ..model_config import mc

from ..errors import ConfigError
from . import autocomplete, ensemble, repository, unsupported

ERROR, WARNING, INFO = "error", "warning", "info"
JSON_FIELDS = ("model", "version", "file", "line", "severity", "message", "fix")
# Triton's place for model_warmup's input_data_file: a model directory's one
# subdirectory that is not a version.
WARMUP_DIR = "warmup"


@dataclasses.dataclass
class Finding:
    model: str | None  # the model's directory name; None: the repository itself
    version: int | None  # None: the whole model
    file: str
    line: int | None
    severity: str  # ERROR, WARNING or INFO
    message: str
    fix: str
    column: int | None = None  # text output only
    kind: str = ""  # what it is about: a start's error of the same kind is not listed again

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in JSON_FIELDS}

    def where(self) -> str:
        return self.file + "".join(f":{n}" for n in (self.line, self.column) if n)


@dataclasses.dataclass
class Report:
    root: Path
    models: list[str]  # the model directories checked
    findings: list[Finding]

    @property
    def errors(self) -> int:
        return sum(f.severity == ERROR for f in self.findings)


def validate_repository(path: str | Path, auto_complete: bool = True) -> Report:
    """Every problem of the repository at `path` (a directory; ConfigError if not), in
    model order. auto_complete: as `serve`'s (--disable-auto-complete-config)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a directory")
    findings: list[Finding] = []
    if (root / "config.pbtxt").is_file():
        findings.append(Finding(
            None, None, str(root / "config.pbtxt"), None, ERROR,
            f"{root} holds a config.pbtxt: it looks like a model directory, not a repository",
            f"validate the repository that holds it: shmserve validate {root.parent}",
            kind="layout"))
    with _captured_logs() as records:
        try:
            specs, problems = repository.scan_repository(root, auto_complete)
        except ConfigError as e:  # no model directory at all
            findings.append(Finding(None, None, str(root), None, ERROR, e.msg,
                                    "add a model: <repository>/<model>/config.pbtxt and "
                                    "<repository>/<model>/1/<model file>", kind="layout"))
            return Report(root, [], findings)
        names = sorted({s.name for s in specs} | {p.name for p in problems})
        checks = [_ModelCheck(root / name, auto_complete) for name in names]
        for check in checks:
            try:
                check.run()
            except (OSError, UnicodeDecodeError) as e:  # a file or directory it cannot read
                check.add(ERROR, "unreadable", f"cannot be read: {e}",
                          "give the server's user read access to the model directory",
                          file=check.dir)
    for check in checks:
        check.add_start_problems([p for p in problems if p.name == check.dir.name])
    _add_log_findings(root, checks, records)
    _add_duplicates(checks)
    for check in checks:  # a model's findings in file and line order
        findings += sorted(check.findings, key=lambda f: (f.file, f.line or 0))
    return Report(root, names, findings)


def format_report(report: Report) -> str:
    """The text report: one `file:line:col: severity: message` line per finding, its
    fix below, and a summary line."""
    out, findings, n_models = [], report.findings, len(report.models)
    for f in findings:
        about = (f" [model '{f.model}'"
                 + (f" version {f.version}" if f.version is not None else "") + "]"
                 if f.model else "")
        out.append(f"{f.where()}: {f.severity}: {f.message}{about}")
        out.append(f"    fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in (ERROR, WARNING)}
    ran = any(f.severity == INFO for f in findings)
    summary = (f"{report.root}: {n_models} model{'s' * (n_models != 1)}, "
               + (", ".join(f"{n} {s}{'s' * (n != 1)}" for s, n in counts.items() if n)
                  or "no problem")
               + " (checked without serving: no segment, no process, "
               + ("no model code except the auto_complete_config hooks above)" if ran
                  else "no model code)"))
    return "\n".join(out + [summary])


# ----------------------------------------------------------------- one model's checks

class _ModelCheck:
    def __init__(self, model_dir: Path, auto_complete: bool):
        self.dir = model_dir
        self.auto_complete = auto_complete
        self.config_path = model_dir / "config.pbtxt"
        self.text = ""  # config.pbtxt as written ("" when there is none)
        self.cfg: mc.ModelConfig | None = None  # as parsed, before auto-complete
        self.findings: list[Finding] = []
        self.declared_name = model_dir.name

    def add(self, severity: str, kind: str, message: str, fix: str, *,
            file: Path | str | None = None, line: int | None = None, column: int | None = None,
            version: int | None = None) -> None:
        finding = Finding(self.dir.name, version, str(file or self.config_path), line, severity,
                          message, fix, column, kind)
        if all(finding.to_dict() != f.to_dict() for f in self.findings):
            self.findings.append(finding)

    def run(self) -> None:
        if self.config_path.is_file():
            self._parse()
        versions = self._check_layout()
        if self.cfg is None:
            return  # no config (auto-complete's case: the start's checks say it all)
        cfg = self.cfg
        if cfg.name and cfg.name != self.dir.name:
            self.declared_name = cfg.name
            self.add(ERROR, "name", f"name '{cfg.name}' differs from its directory "
                     f"'{self.dir.name}' (a model is named by its directory)",
                     f'write name: "{self.dir.name}", or rename the directory to {cfg.name}',
                     line=self.top_line("name"))
        backend = self._check_backend(cfg)
        self._check_unsupported(cfg)
        if backend is None or backend == ensemble.PLATFORM:  # an ensemble has no model file
            return
        model_file = cfg.default_model_filename or repository.BACKENDS[backend][1]
        if Path(model_file).name != model_file:
            return  # not a file name: the start refuses it (add_start_problems)
        for v, vdir in versions:
            path = vdir / model_file
            if not path.is_file():
                self._missing_model_file(v, vdir, model_file, backend)
            elif backend == autocomplete.ONNX_BACKEND:
                self._check_onnx(v, path)

    def _check_unsupported(self, cfg: mc.ModelConfig) -> None:
        """unsupported.check, once per field it refuses (it stops at the first: each is
        cleared from a copy and the check run again) and for the fields it warns about
        (logged, caught by validate_repository)."""
        copy, where = mc.ModelConfig.FromString(cfg.SerializeToString()), str(self.config_path)
        for _ in range(64):  # more than the fields it can refuse
            try:
                unsupported.check(copy, where)
                return
            except ConfigError as e:
                self.add_start_problems([repository.ModelProblem(self.dir.name, None, e.msg)])
                if not _clear_refused(copy, e.msg.removeprefix(f"{where}: ")):
                    return

    # -- the directory ------------------------------------------------------------
    def _check_layout(self) -> list[tuple[int, Path]]:
        """The version directories, by number; a finding for each other directory
        and for none at all."""
        versions = []
        for sub in sorted(self.dir.iterdir()):
            if not sub.is_dir() or sub.name.startswith("."):
                continue
            if repository._VERSION_RE.match(sub.name):  # the server's own rule
                versions.append((int(sub.name), sub))
            elif sub.name != WARMUP_DIR:
                self.add(ERROR, "versions", f"directory '{sub.name}' is not a version directory "
                         "(those are named by a number not starting with 0); the server "
                         "ignores it, as Triton does",
                         "rename it to a version number, e.g. "
                         f"{self.dir / _suggest_version(sub.name, versions)}, or move it out of "
                         "the model directory", file=sub)
        if not versions:
            backend = self._backend_name()
            expected = ((self.cfg.default_model_filename or repository.BACKENDS[backend][1])
                        if backend else None)
            fix = f"create {self.dir / '1'}/ and put {expected or 'the model file'} in it"
            if expected and (self.dir / expected).is_file():
                fix = f"move {self.dir / expected} to {self.dir / '1' / expected}"
            self.add(ERROR, "versions", "no version directory: a model's files go in "
                     "<model>/<version>/", fix, file=self.dir)
        return sorted(versions)

    def _missing_model_file(self, version: int, vdir: Path, model_file: str, backend: str) -> None:
        named = ("default_model_filename names it" if self.cfg.default_model_filename else
                 f"the {backend} backend's default name")
        fix = f"put the model file at {vdir / model_file}"
        suffix = Path(model_file).suffix
        others = sorted(p.name for p in vdir.iterdir() if p.is_file() and suffix
                        and p.suffix == suffix)
        if len(others) == 1:
            fix = (f"rename {vdir / others[0]} to {model_file}, or write "
                   f'default_model_filename: "{others[0]}" in {self.config_path}')
        self.add(ERROR, "model-file", f"version {version} has no model file {model_file} "
                 f"({named})", fix, file=vdir / model_file, version=version)

    # -- config.pbtxt -------------------------------------------------------------
    def _parse(self) -> None:
        where = str(self.config_path)
        try:
            self.text = self.config_path.read_text()
            self.cfg = repository.parse_config(self.text, where)
        except (OSError, UnicodeDecodeError) as e:
            self.add(ERROR, "syntax", f"cannot be read ({e})",
                     "make it a readable UTF-8 text file")
        except ConfigError as e:
            m = re.match(re.escape(where) + r"(?::(\d+):(\d+))?: (.*)$", e.msg, re.S)
            line, col, message = (int(m[1]) if m[1] else None, int(m[2]) if m[2] else None,
                                  m[3]) if m else (None, None, e.msg)
            self.add(ERROR, "syntax", message, _syntax_fix(message, line), line=line,
                     column=col)

    def _backend_name(self) -> str | None:
        """The backend the config names (by backend or platform), if it is one."""
        if self.cfg is None:
            return None
        platform = self.cfg.platform
        backend = self.cfg.backend or repository._PLATFORM_TO_BACKEND.get(platform, platform)
        return backend if backend in repository.BACKENDS else None

    def _check_backend(self, cfg: mc.ModelConfig) -> str | None:
        """The config's backend, or None with a finding for each name that is wrong."""
        backends = sorted(repository.BACKENDS)
        platforms = sorted(repository._PLATFORM_TO_BACKEND)
        by_platform = repository._PLATFORM_TO_BACKEND.get(cfg.platform)
        unknown_backend = cfg.backend and cfg.backend not in repository.BACKENDS
        unknown_platform = (cfg.platform and by_platform is None
                            and cfg.platform not in repository.BACKENDS)
        mismatch = cfg.backend and by_platform and cfg.backend != by_platform
        if unknown_backend:
            self.add(ERROR, "backend", f"backend '{cfg.backend}' is not supported "
                     f"(supported: {', '.join(backends)})",
                     _choose("backend", cfg.backend, backends), line=self.top_line("backend"))
        if unknown_platform:
            self.add(ERROR, "backend", f"platform '{cfg.platform}' is not supported "
                     f"(supported: {', '.join(platforms)})",
                     _choose("platform", cfg.platform, platforms)
                     + " (or name the backend instead: backend: \"...\")",
                     line=self.top_line("platform"))
        if mismatch:
            self.add(ERROR, "backend", f"platform '{cfg.platform}' and backend '{cfg.backend}' "
                     f"disagree (platform '{cfg.platform}' is the '{by_platform}' backend's)",
                     f'write backend: "{by_platform}", or name only the backend and remove '
                     "platform", line=self.top_line("platform") or self.top_line("backend"))
        if not cfg.backend and not cfg.platform:
            self.add(ERROR, "backend", "names neither a backend nor a platform",
                     f"add backend: \"...\" (one of {', '.join(backends)})")
            return None
        if unknown_backend or mismatch or (unknown_platform and not cfg.backend):
            return None
        return self._backend_name()

    # -- the model file against the config ----------------------------------------
    def _check_onnx(self, version: int, path: Path) -> None:
        """Each tensor the config names against the ONNX graph (read with onnx, as
        auto-complete reads it): name, data type, dims; and max_batch_size against
        the graph's first dimensions."""
        try:
            g_inputs, g_outputs = autocomplete.graph_tensors(path)
        except ConfigError as e:
            self.add(ERROR, "model-file", e.msg.removeprefix(f"{path}: "),
                     f"replace {path} with a complete ONNX model (onnx.checker.check_model "
                     "accepts it)", file=path, version=version)
            return
        cfg, mbs = self.cfg, self.cfg.max_batch_size
        fixed = [(kind, name, dims)
                 for kind, tensors in (("input", g_inputs), ("output", g_outputs))
                 for name, _, dims in tensors if not dims or dims[0] != -1]
        if mbs > 0 and fixed:
            kind, name, dims = fixed[0]
            self.add(ERROR, "batch", f"max_batch_size {mbs}, but the ONNX graph {path} cannot "
                     f"take a batch: its {kind} '{name}' has shape {dims} (the first dimension "
                     "is fixed)", f"write max_batch_size: 0 and give each tensor's full shape "
                     f"in dims (e.g. dims: {dims}), or export the model with a dynamic first "
                     "(batch) dimension", line=self.top_line("max_batch_size"), version=version)
        graph = {"input": {n: (t, d) for n, t, d in g_inputs},
                 "output": {n: (t, d) for n, t, d in g_outputs}}
        for kind, items in (("input", cfg.input), ("output", cfg.output)):
            known = graph[kind]
            for t in items:
                line = self.tensor_line(kind, t.name)
                if t.name not in known:
                    self.add(ERROR, "tensor", f"{kind} '{t.name}' is not an {kind} of the ONNX "
                             f"graph {path} (its {kind}s: {', '.join(sorted(known))})",
                             _choose("name", t.name, sorted(known)),
                             line=line, version=version)
                    continue
                dtype, dims = known[t.name]
                if dtype == mc.TYPE_INVALID:
                    self.add(ERROR, "tensor", f"{kind} '{t.name}' of the ONNX graph {path} has an "
                             "element type Triton has no data type for",
                             "export the model with a supported element type (bool, ints, "
                             "floats, string)", line=line, version=version)
                elif t.data_type not in (mc.TYPE_INVALID, dtype):
                    self.add(ERROR, "tensor", f"{kind} '{t.name}' has data_type "
                             f"{mc.DataType.Name(t.data_type)}, the ONNX graph {path} "
                             f"{mc.DataType.Name(dtype)}",
                             f"write data_type: {mc.DataType.Name(dtype)}", line=line,
                             version=version)
                if t.dims and not (kind == "input" and t.allow_ragged_batch):
                    # (a ragged input reaches the graph as one flat concatenation)
                    self._check_dims(kind, t.name, list(t.dims), dims, path, version, line)

    def _check_dims(self, kind: str, name: str, dims: list[int], graph: list[int], path: Path,
                    version: int, line: int | None) -> None:
        mbs = self.cfg.max_batch_size
        # max_batch_size 0 with dims one shorter than the graph's: auto-complete takes the
        # first dimension for the batch (autocomplete.complete_onnx_config's rank hint)
        batched = mbs > 0 or (self.auto_complete and mbs == 0 and len(dims) == len(graph) - 1
                              and graph and graph[0] == -1)
        expected = graph[1:] if batched else graph
        what = (f"{kind} '{name}' has dims {dims}; the ONNX graph {path} gives it shape {graph}"
                + (", whose first dimension is the batch (left out of dims when "
                   "max_batch_size > 0)" if batched else ""))
        if len(dims) != len(expected):
            fix = f"write dims: {expected}"
            if not batched and len(dims) == len(graph) - 1:
                fix += (" (or max_batch_size > 0, if the first dimension is the batch)")
            self.add(ERROR, "tensor", f"{what}: {len(dims)} dimensions where the model has "
                     f"{len(expected)}", fix, line=line, version=version)
            return
        merged = [g if g > 0 else c for c, g in zip(dims, expected)]
        if any(g > 0 and c > 0 and c != g for c, g in zip(dims, expected)):
            self.add(ERROR, "tensor", f"{what}: the sizes disagree", f"write dims: {merged}",
                     line=line, version=version)
        elif any(g > 0 and c == -1 for c, g in zip(dims, expected)):
            self.add(WARNING, "tensor-dims", f"{what}: the config accepts any size where the "
                     "model takes only one (a request of another size fails at inference)",
                     f"write dims: {merged}", line=line, version=version)

    # -- a start's problems -------------------------------------------------------
    def add_start_problems(self, problems: list) -> None:
        """The start's verdict (repository.ModelProblem) as findings, each unless a
        finding of this module already says it."""
        own = {f.kind for f in self.findings if f.severity == ERROR}
        for p in problems:
            file, line, column, message = self.split(p.reason)
            kind, fix, locate = _classify(message)
            if column is not None:  # the text-format parser's: said by _parse
                kind = "syntax"
            if own & _SAME_KIND.get(kind, {kind}) and kind != "unsupported":
                continue
            if (self.auto_complete and own & {"versions", "model-file"}
                    and message.startswith("the model declares no")):
                continue  # auto-complete had no model file to read the tensors from
            if line is None and file == str(self.config_path):
                line = locate(self, message)
            self.add(ERROR, kind, message, self.fill(fix), file=file, line=line, column=column,
                     version=p.version)

    def fill(self, fix: str) -> str:
        """A _START_PROBLEMS fix with this model's {dir}, {dir.name} and {config}."""
        return (fix.replace("{dir.name}", self.dir.name).replace("{dir}", str(self.dir))
                .replace("{config}", str(self.config_path)))

    def split(self, reason: str) -> tuple[str, int | None, int | None, str]:
        """(file, line, column, message) of a message that starts with a path."""
        return _split(reason, self.dir, str(self.config_path))

    # -- where in config.pbtxt ----------------------------------------------------
    def top_line(self, field: str) -> int | None:
        """The line where top-level `field` is written."""
        return next((n for n, depth, _, text in _outline(self.text)
                     if depth == 0 and re.match(rf"\s*{field}\b", text)), None)

    def tensor_line(self, kind: str, name: str) -> int | None:
        """The line where input/output `name` is declared."""
        pattern = re.compile(rf'\bname\s*:\s*"{re.escape(name)}"')
        outline = _outline(self.text)
        return (next((n for n, _, top, text in outline if top == kind and pattern.search(text)),
                     None)
                or next((n for n, _, _, text in outline if pattern.search(text)), None)
                or self.top_line(kind))

    def word_line(self, word: str) -> int | None:
        return next((n for n, _, _, text in _outline(self.text)
                     if re.search(rf"\b{re.escape(word)}\b", text)), None)


# ------------------------------------------------------------------------- helpers

def _split(reason: str, model_dir: Path, config: str) -> tuple[str, int | None, int | None, str]:
    for prefix in (config, str(model_dir)):
        m = re.match(re.escape(prefix) + r"(?::(\d+):(\d+))?: (.*)$", reason, re.S)
        if m:
            return (prefix, int(m[1]) if m[1] else None, int(m[2]) if m[2] else None, m[3])
    m = re.match(re.escape(str(model_dir)) + r"/([^:]*): (.*)$", reason, re.S)
    if m:  # a file of the model: its model file, a version directory
        return str(model_dir / m[1]), None, None, m[2]
    return str(model_dir), None, None, reason


def _outline(text: str) -> list[tuple[int, int, str | None, str]]:
    """(line number, nesting depth at its start, the top-level field whose value it
    is part of, the line without its comment) of each line of a text-format config."""
    out, depth, top = [], 0, None
    for n, raw in enumerate(text.splitlines(), 1):
        code, quote = [], None
        for i, ch in enumerate(raw):
            if quote:
                if ch == quote and raw[i - 1] != "\\":
                    quote = None
            elif ch in "\"'":
                quote = ch
            elif ch == "#":
                break
            code.append(ch)
        line = "".join(code)
        if depth == 0 and (m := re.match(r"\s*([A-Za-z_]\w*)", line)):
            top = m[1]
        out.append((n, depth, top, line))
        stripped = re.sub(r"\"(\\.|[^\"\\])*\"|'(\\.|[^'\\])*'", "", line)
        depth = max(0, depth + sum(stripped.count(c) for c in "{[<")
                    - sum(stripped.count(c) for c in "}]>"))
    return out


def _clear_refused(cfg: mc.ModelConfig, message: str) -> bool:
    """Clears from cfg the field an unsupported.check refusal names; False if none."""
    m = re.match(r"(input|output) '([^']*)' (\w+) ", message)
    if m:
        for t in cfg.input if m[1] == "input" else cfg.output:
            if t.name == m[2] and m[3] in t.DESCRIPTOR.fields_by_name:
                t.ClearField(m[3])
                return True
        return False
    for field, _ in cfg.ListFields():
        if message.startswith(field.name) or (field.name == "model_transaction_policy"
                                              and field.name in message):
            cfg.ClearField(field.name)
            return True
    return False


def _suggest_version(name: str, versions: list[tuple[int, Path]]) -> str:
    digits = re.sub(r"\D", "", name).lstrip("0")
    return digits or str(max((v for v, _ in versions), default=0) + 1)


def _choose(field: str, value: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(value, choices, 1, 0.5)
    if close:
        return f'write {field}: "{close[0]}"'
    return f"write {field} as one of: {', '.join(choices)}"


def _syntax_fix(message: str, line: int | None) -> str:
    """What to write instead, for a text-format ParseError's message."""
    pool = descriptor_pool.Default()
    m = re.search(r'Message type "([\w.]+)" has no field named "(\w+)"', message)
    if m:
        try:
            fields = sorted(pool.FindMessageTypeByName(m[1]).fields_by_name)
        except KeyError:
            fields = []
        close = difflib.get_close_matches(m[2], fields, 1, 0.6)
        if close:
            return f"rename {m[2]} to {close[0]} (a field of {m[1]})"
        return (f"remove {m[2]}: {m[1]} (Triton's model_config.proto) has no such field; "
                f"its fields: {', '.join(fields)}")
    m = re.search(r'Enum type "([\w.]+)" has no value named (\w+)', message)
    if m:
        try:
            values = list(pool.FindEnumTypeByName(m[1]).values_by_name)
        except KeyError:
            values = []
        close = difflib.get_close_matches(m[2], values, 1, 0.6)
        return (f"write {close[0]}" if close else f"write one of {', '.join(values)}") \
            + f" ({m[1]})"
    if "Couldn't parse integer" in message or "Couldn't parse float" in message:
        return "write a number there"
    at = f" at line {line}" if line else ""
    return (f"correct the protobuf text format{at}: `field: value`, messages in {{ }}, "
            "lists in [ ], strings in double quotes")


def _locate_field(*fields: str):
    def locate(check: _ModelCheck, message: str) -> int | None:
        return next((n for f in fields if (n := check.top_line(f))), None)
    return locate


def _locate_named(check: _ModelCheck, message: str) -> int | None:
    """The line of the tensor, or else of the field, a message names."""
    m = re.search(r"\b(input|output) '([^']+)'", message)
    if m:
        return check.tensor_line(m[1], m[2])
    m = re.match(r"(?:(?:input|output) '[^']+' )?([a-z_]+(?: [a-z_]+)*?) is not implemented",
                 message)
    if m:
        return check.word_line(m[1].split()[-1])
    return None


# Kinds that say the same of a model: a start says "no version directory holds
# model.py" where this module says which directory lacks it, or that there is none.
_SAME_KIND = {"versions": {"versions", "model-file"}, "model-file": {"versions", "model-file"}}

# A start's error messages (repository.load_model and what it calls), by what they
# are about: (pattern, kind, fix, where in config.pbtxt). {dir} and {config} are the
# model's. First match wins.
_START_PROBLEMS = [
    (r"missing \(every model needs a config\.pbtxt", "config",
     "write {config} (name, backend, max_batch_size, input, output), or validate and serve "
     "without --disable-auto-complete-config", _locate_field()),
    (r"missing, and no <version>/", "config",
     "write {config} naming its backend or platform, inputs and outputs, or put its "
     "model.onnx or model.py in a version directory such as {dir}/1/", _locate_field()),
    (r"differs from its directory", "name", 'write name: "{dir.name}", or rename the directory',
     _locate_field("name")),
    (r"model name .* must be", "name",
     "rename the model (directory and name:) with letters, digits, '_', '.', '-' only",
     _locate_field("name")),
    (r"^(backend|platform) .*(not supported|disagree)|names neither a backend", "backend",
     "write backend: \"...\" as one of the backends the message lists", _locate_field(
         "backend", "platform")),
    (r"no version directory", "versions",
     "create a version directory such as {dir}/1/ holding the model file the message names",
     _locate_field()),
    (r"missing \(the model file", "model-file", "put the model file where the message says",
     _locate_field()),
    (r"version_policy", "policy",
     "create the version directories version_policy names, or change version_policy "
     "(latest, all or specific)", _locate_field("version_policy")),
    (r"cannot batch", "batch",
     "write max_batch_size: 0 with each tensor's full shape in dims, or export the model "
     "with a dynamic first (batch) dimension", _locate_field("max_batch_size")),
    (r"not a readable ONNX model", "model-file",
     "replace the file with a complete ONNX model (onnx.checker.check_model accepts it)",
     _locate_field()),
    (r"ONNX graph", "tensor",
     "make the config's name and data_type agree with the ONNX graph's (or leave them out: "
     "auto-complete reads them from the graph)", _locate_named),
    (r"auto_complete_config", "hook",
     "correct the model's auto_complete_config (its error is above), or write a complete "
     "config.pbtxt and use --disable-auto-complete-config", _locate_field()),
    (r"is not implemented by shmserve yet|decoupled", "unsupported",
     "remove it: shmserve does not implement it yet, and serving the model without it "
     "would change its results", _locate_named),
    (r"max_batch_size .* must be >= 0", "config",
     "write max_batch_size: 0 (no batching) or the largest batch", _locate_field(
         "max_batch_size")),
    (r"dynamic_batching needs", "config",
     "write max_batch_size > 0, or remove dynamic_batching", _locate_field(
         "dynamic_batching", "max_batch_size")),
    (r"preferred_batch_size", "config",
     "keep each preferred_batch_size within 1..max_batch_size", _locate_field(
         "dynamic_batching")),
    (r"instance_group", "config",
     "write instance_group [ { count: 1 kind: KIND_CPU } ] (count >= 1; kind KIND_CPU, "
     "KIND_GPU with gpus the server sees, or left out)", _locate_field("instance_group")),
    (r"declared twice", "tensor", "give each input and output a name of its own",
     _locate_named),
    (r"declares no", "tensor",
     "declare it: input [ { name: \"...\" data_type: TYPE_FP32 dims: [ -1 ] } ] (output alike)",
     _locate_field("input", "output")),
    (r"data_type", "tensor",
     "write a data_type shmserve serves: TYPE_BOOL, TYPE_(U)INT8..64, TYPE_FP16/32/64, "
     "TYPE_BF16 or TYPE_STRING", _locate_named),
    (r"dims|\(limit \d+", "tensor",
     "write dims as sizes > 0 or -1 (any size), within the limits the message gives",
     _locate_named),
    (r"default_model_filename", "config",
     "write default_model_filename as a file name in the version directory (no '/')",
     _locate_field("default_model_filename")),
    (r'parameters "', "config", "write the parameter's value as one the message names",
     _locate_field("parameters")),
]


def _classify(message: str):
    for pattern, kind, fix, locate in _START_PROBLEMS:
        if re.search(pattern, message):
            return kind, fix, locate
    return ("other", "correct what the message names (README.md, Model repository, lists "
            "what shmserve serves)", lambda check, message: None)


def _add_log_findings(root: Path, checks: list[_ModelCheck], records: list) -> None:
    """The warnings and errors a start logs (unsupported.py's ignored fields, ...),
    and each auto_complete_config hook it ran, as findings of their model."""
    by_dir = {str(c.dir): c for c in checks}
    for record in records:
        text = record.getMessage()
        check = next((c for d, c in by_dir.items() if text.startswith((d + "/", d + ":"))),
                     None)
        if check is None:
            continue
        file, line, column, message = check.split(text)
        if getattr(record, "model_code", None):
            check.add(INFO, "hook", f"ran {record.model_code}'s auto_complete_config (model "
                      "code, in a process of its own, as a start runs it)",
                      "nothing to fix; --disable-auto-complete-config checks without running "
                      "it (the config must then be complete)", file=record.model_code)
        elif record.levelno >= logging.ERROR:
            kind, fix, locate = _classify(message)
            check.add(ERROR, kind, message, check.fill(fix),
                      file=file, line=line or locate(check, message), column=column)
        elif record.levelno >= logging.WARNING:
            ignored = "is not implemented by shmserve yet and is ignored" in message
            check.add(WARNING, "ignored" if ignored else "warning", message,
                      "remove it, or keep it knowing shmserve ignores it (it changes when or "
                      "how fast requests run, not their results)" if ignored else
                      "the model loads as the message says; change what it names if that is "
                      "not what you meant", file=file,
                      line=line or (_locate_named(check, message) if ignored else None),
                      column=column)


def _add_duplicates(checks: list[_ModelCheck]) -> None:
    """Two model directories whose configs declare the same model name."""
    by_name: dict[str, list[_ModelCheck]] = {}
    for c in checks:
        by_name.setdefault(c.declared_name, []).append(c)
    for name, same in by_name.items():
        for c in same:
            if len(same) > 1 and c.dir.name != name:
                others = ", ".join(str(o.config_path if o.cfg is not None else o.dir)
                                   for o in same if o is not c)
                c.add(ERROR, "duplicate", f"model name '{name}' is also declared by {others}",
                      f'give each model a name of its own: write name: "{c.dir.name}" (its '
                      "directory's)", line=c.top_line("name"))


@contextlib.contextmanager
def _captured_logs():
    """The shmserve log records made meanwhile (info and up), kept from the terminal."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("shmserve")
    handler = Keep(logging.INFO)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
