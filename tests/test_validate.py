"""`shmserve validate DIR` (issue 10): a repository checked without serving it. Each
case is a repository with one mistake; the finding must name the file (and the line,
where the config parser gives one or the field is written) and say how to fix it.
Exit status: 0 without error (warnings allowed), 1 with errors, 2 when DIR is not a
directory."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import IDENTITY_CODE, copy_bundled, python_config, write_model
from test_autocomplete import onnx_model

from shmserve import cli
from shmserve.server.validate import JSON_FIELDS

pytestmark = pytest.mark.timeout(120)


def validate(capsys, repo: Path, *args: str) -> tuple[int, list[dict]]:
    """(exit status, findings) of `shmserve validate --json`, run in this process."""
    rc = cli.main(["validate", str(repo), "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def only(findings: list[dict], model: str, severity: str = "error") -> dict:
    """The one finding of `model` with `severity`."""
    found = [f for f in findings if f["model"] == model and f["severity"] == severity]
    assert len(found) == 1, json.dumps(findings, indent=1)
    return found[0]


def config_line(repo: Path, model: str, needle: str) -> int:
    """The line of the model's config.pbtxt that holds `needle` (1-based)."""
    lines = (repo / model / "config.pbtxt").read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if needle in text)


@pytest.fixture
def repo(tmp_path, mlp_onnx) -> Path:
    """The bundled models (valid), to which each test adds its broken one."""
    copy_bundled(tmp_path, mlp_onnx)
    return tmp_path


def test_the_bundled_repository_is_valid(repo, capsys):
    assert cli.main(["validate", str(repo)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == (f"{repo}: 3 models, no problem (checked without serving: no segment, "
                           "no process, no model code)"), out
    assert validate(capsys, repo) == (0, [])


def test_bad_pbtxt_syntax_names_file_line_and_column(repo, capsys):
    write_model(repo, "bad", 'name: "bad"\nbackend: "python"\nmax_batch_size: eight\n',
                IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "bad")
    assert rc == 1
    assert (f["file"], f["line"]) == (str(repo / "bad" / "config.pbtxt"), 3)
    assert "Couldn't parse integer: eight" in f["message"]
    assert f["fix"] == "write a number there"
    cli.main(["validate", str(repo)])  # the text report gives the column too
    assert f"{repo / 'bad' / 'config.pbtxt'}:3:17: error: " in capsys.readouterr().out


def test_unknown_field_suggests_the_field_meant(repo, capsys):
    write_model(repo, "typo", 'name: "typo"\nbackend: "python"\nmax_batch_sise: 8\n',
                IDENTITY_CODE)
    write_model(repo, "typo_in", python_config("typo_in").replace("data_type", "datatype", 1),
                IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "typo")
    assert rc == 1 and (f["file"], f["line"]) == (str(repo / "typo" / "config.pbtxt"), 3)
    assert 'no field named "max_batch_sise"' in f["message"]
    assert f["fix"] == "rename max_batch_sise to max_batch_size (a field of inference.ModelConfig)"
    f = only(findings, "typo_in")  # a field of an input: ModelInput's fields
    assert f["line"] == config_line(repo, "typo_in", "datatype")
    assert "rename datatype to data_type" in f["fix"] and "inference.ModelInput" in f["fix"]


def test_a_directory_that_is_not_a_version(repo, capsys):
    model = write_model(repo, "m", python_config("m"), IDENTITY_CODE)
    (model / "v2").mkdir()
    (model / "v2" / "model.py").write_text(IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "m")
    assert rc == 1 and f["file"] == str(model / "v2") and f["line"] is None
    assert "'v2' is not a version directory" in f["message"] and "ignores it" in f["message"]
    assert f"rename it to a version number, e.g. {model / '2'}" in f["fix"]


def test_a_model_without_any_version_directory(repo, capsys):
    model = write_model(repo, "flat", python_config("flat"), versions=())
    (model / "model.py").write_text(IDENTITY_CODE)  # beside config.pbtxt, not in 1/
    rc, findings = validate(capsys, repo)
    f = only(findings, "flat")  # the start's "no version directory holds model.py" is this one
    assert rc == 1 and f["file"] == str(model)
    assert f["message"].startswith("no version directory")
    assert f["fix"] == f"move {model / 'model.py'} to {model / '1' / 'model.py'}"


def test_a_missing_model_file_names_the_file_expected(repo, capsys):
    # version 2 lacks model.py: the start would quietly serve version 1
    write_model(repo, "two", python_config("two"), IDENTITY_CODE, versions=(1,))
    (repo / "two" / "2").mkdir()
    # default_model_filename names the file; the version holds another .onnx
    onnx_model(repo, "named", ["b", 3], ["b", 3], 'name: "named"\nbackend: "onnxruntime"\n'
               'default_model_filename: "net.onnx"\n')
    rc, findings = validate(capsys, repo)
    f = only(findings, "two")
    assert rc == 1 and (f["file"], f["version"]) == (str(repo / "two" / "2" / "model.py"), 2)
    assert "no model file model.py (the python backend's default name)" in f["message"]
    assert f["fix"] == f"put the model file at {repo / 'two' / '2' / 'model.py'}"
    f = only(findings, "named")
    assert f["file"] == str(repo / "named" / "1" / "net.onnx")
    assert "net.onnx (default_model_filename names it)" in f["message"]
    assert f["fix"].startswith(f"rename {repo / 'named' / '1' / 'model.onnx'} to net.onnx")


def test_dims_that_disagree_with_the_onnx_graph(repo, capsys):
    config = ('name: "dims"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
              'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
              'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3, 1 ] } ]\n')
    onnx_model(repo, "dims", ["b", 3], ["b", 3], config)
    rc, findings = validate(capsys, repo)
    by_line = {f["line"]: f for f in findings if f["model"] == "dims"}
    assert rc == 1 and sorted(by_line) == [4, 5], findings
    x, y = by_line[4], by_line[5]
    assert x["file"] == str(repo / "dims" / "config.pbtxt") and x["version"] == 1
    assert "input 'X' has dims [4]" in x["message"] and "shape [-1, 3]" in x["message"]
    assert str(repo / "dims" / "1" / "model.onnx") in x["message"]
    assert x["fix"] == "write dims: [3]"
    assert "2 dimensions where the model has 1" in y["message"] and y["fix"] == "write dims: [3]"


def test_a_data_type_that_disagrees_with_the_onnx_graph(repo, capsys):
    config = ('name: "types"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
              'input [\n  { name: "X" data_type: TYPE_FP32 dims: [ 3 ] }\n]\n'
              'output [\n  { name: "Y" data_type: TYPE_INT64 dims: [ 3 ] }\n]\n')
    onnx_model(repo, "types", ["b", 3], ["b", 3], config, dtype="INT32")
    rc, findings = validate(capsys, repo)
    by_line = {f["line"]: f for f in findings if f["model"] == "types"}
    # both tensors, though a start stops at the first
    assert rc == 1 and sorted(by_line) == [5, 8], findings
    assert "input 'X' has data_type TYPE_FP32" in by_line[5]["message"]
    assert "TYPE_INT32" in by_line[5]["message"]
    assert by_line[5]["fix"] == by_line[8]["fix"] == "write data_type: TYPE_INT32"


def test_an_unknown_backend(repo, capsys):
    write_model(repo, "b", python_config("b").replace('backend: "python"', 'backend: "pyton"'),
                IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "b")  # the start says the same: listed once
    assert rc == 1 and f["line"] == config_line(repo, "b", "backend")
    assert "backend 'pyton' is not supported" in f["message"]
    assert f["fix"] == 'write backend: "python"'


def test_an_unknown_platform(repo, capsys):
    onnx_model(repo, "p", ["b", 3], ["b", 3], 'name: "p"\nplatform: "onnxruntime_onx"\n')
    rc, findings = validate(capsys, repo)
    f = [f for f in findings if f["model"] == "p" and "platform" in f["message"]]
    assert rc == 1 and len(f) == 1, findings
    assert f[0]["line"] == 2 and "platform 'onnxruntime_onx' is not supported" in f[0]["message"]
    assert f[0]["fix"].startswith('write platform: "onnxruntime_onnx"')


def test_platform_and_backend_that_disagree(repo, capsys):
    write_model(repo, "mix", python_config("mix").replace(
        'backend: "python"', 'backend: "python"\nplatform: "onnxruntime_onnx"'), IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "mix")
    assert rc == 1 and f["line"] == config_line(repo, "mix", "platform")
    assert "platform 'onnxruntime_onnx' and backend 'python' disagree" in f["message"]
    assert f["fix"] == 'write backend: "onnxruntime", or name only the backend and remove platform'


def test_a_name_that_differs_from_its_directory(repo, capsys):
    write_model(repo, "dirname", python_config("othername"), IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "dirname")
    assert rc == 1 and f["line"] == 1 and f["file"] == str(repo / "dirname" / "config.pbtxt")
    assert "name 'othername' differs from its directory 'dirname'" in f["message"]
    assert f["fix"] == 'write name: "dirname", or rename the directory to othername'


def test_duplicate_model_names(repo, capsys):
    write_model(repo, "copy", python_config("identity"), IDENTITY_CODE)  # identity's copy
    rc, findings = validate(capsys, repo)
    dup = [f for f in findings if f["model"] == "copy" and "also declared" in f["message"]]
    assert rc == 1 and len(dup) == 1, findings
    assert dup[0]["line"] == 1
    assert f"model name 'identity' is also declared by {repo / 'identity' / 'config.pbtxt'}" \
        in dup[0]["message"]
    assert 'write name: "copy"' in dup[0]["fix"]
    assert not [f for f in findings if f["model"] == "identity"]  # the original is fine


def test_max_batch_size_with_a_fixed_first_dimension(repo, capsys):
    onnx_model(repo, "fixed", [2, 3], [2, 3],
               'name: "fixed"\nbackend: "onnxruntime"\nmax_batch_size: 8\n')
    rc, findings = validate(capsys, repo)
    f = only(findings, "fixed")  # the start's "cannot batch" is this one
    assert rc == 1 and f["line"] == 3 and f["version"] == 1
    assert "max_batch_size 8" in f["message"] and "has shape [2, 3]" in f["message"]
    assert f["fix"].startswith("write max_batch_size: 0 and give each tensor's full shape")


def test_fields_refused_are_errors_and_fields_ignored_are_warnings(repo, capsys):
    config = python_config("seq", dims=(4,), dynamic_batching=None, extra=(
        "optimization { priority: PRIORITY_MAX }")).replace(
            "dims: [ 4 ] }", "dims: [ 4 ] is_shape_tensor: true }", 1)
    write_model(repo, "seq", config, IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    errors = {f["line"]: f for f in findings if f["model"] == "seq" and f["severity"] == "error"}
    # every refused field, though the start stops at the first
    assert rc == 1 and sorted(errors) == [4], findings
    assert "is_shape_tensor" in errors[4]["message"]
    assert all(e["fix"].startswith("remove it") for e in errors.values())
    warning = only(findings, "seq", "warning")
    assert warning["line"] == 6
    assert warning["message"].startswith("optimization priority is not implemented")
    assert warning["fix"].startswith("remove it, or keep it")


def test_warnings_alone_exit_0(repo, capsys):
    write_model(repo, "cached", python_config(
        "cached", extra="optimization { priority: PRIORITY_MAX }"), IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    assert rc == 0 and [f["severity"] for f in findings] == ["warning"], findings


def test_json_shape(repo, capsys):
    write_model(repo, "bad", 'name: "bad"\nmax_batch_size: x\n', IDENTITY_CODE)
    (repo / "identity" / "old").mkdir()
    rc, findings = validate(capsys, repo)
    assert rc == 1 and len(findings) == 2
    for f in findings:
        assert tuple(f) == JSON_FIELDS
        assert isinstance(f["model"], str) and isinstance(f["file"], str)
        assert f["line"] is None or isinstance(f["line"], int)
        assert f["version"] is None or isinstance(f["version"], int)
        assert f["severity"] in ("error", "warning", "info")
        assert f["message"] and f["fix"]


def test_exit_2_when_dir_is_not_a_directory(tmp_path):
    for path in (tmp_path / "absent", tmp_path / "file"):
        if path.name == "file":
            path.write_text("")
        r = subprocess.run([sys.executable, "-m", "shmserve.cli", "validate", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert f"{path} is not a directory" in r.stderr and not r.stdout


def test_a_model_directory_given_for_a_repository(repo, capsys):
    rc, findings = validate(capsys, repo / "identity")
    assert rc == 1
    f = [f for f in findings if f["model"] is None]
    assert f and f[0]["file"] == str(repo / "identity" / "config.pbtxt")
    assert f[0]["fix"] == f"validate the repository that holds it: shmserve validate {repo}"


HOOK_CODE = '''
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        return auto_complete_model_config

    def execute(self, requests):
        return []
'''


@pytest.fixture
def forbidden(monkeypatch):
    """Records every segment or process made (and refuses it): [what, ...]."""
    import posix_ipc

    made: list[str] = []

    def refuse(what):
        def call(*args, **kwargs):
            made.append(what)
            raise OSError(f"validate must not call {what}")
        return call

    monkeypatch.setattr(posix_ipc, "SharedMemory", refuse("posix_ipc.SharedMemory"))
    monkeypatch.setattr(os, "memfd_create", refuse("os.memfd_create"))
    monkeypatch.setattr(os, "fork", refuse("os.fork"))
    monkeypatch.setattr(os, "posix_spawn", refuse("os.posix_spawn"))
    monkeypatch.setattr(os, "posix_spawnp", refuse("os.posix_spawnp"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess.Popen"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        refuse("multiprocessing start"))
    return made


def test_validate_creates_no_segment_and_no_process(repo, capsys, forbidden):
    # every kind of problem at once, and an ONNX model without config (auto-complete)
    write_model(repo, "bad", 'name: "bad"\nmax_batch_size: x\n', IDENTITY_CODE)
    write_model(repo, "seq", python_config("seq", dynamic_batching=None,
                                           extra='batch_input [ { kind: BATCH_ELEMENT_COUNT '
                                           'target_name: "N" data_type: TYPE_INT64 '
                                           'source_input: "INPUT0" } ]'), IDENTITY_CODE)
    write_model(repo, "none", python_config("none"), versions=(1,))
    onnx_model(repo, "auto", ["b", 3], ["b", 3])
    onnx_model(repo, "fixed", [2, 3], [2, 3], 'name: "fixed"\nbackend: "onnxruntime"\n'
               'max_batch_size: 8\n')
    rc, findings = validate(capsys, repo)
    assert rc == 1 and {f["model"] for f in findings} == {"bad", "seq", "none", "fixed"}
    assert forbidden == []


def test_without_auto_complete_a_hook_is_not_run(repo, capsys, forbidden):
    model = write_model(repo, "hook", python_config("hook"), HOOK_CODE)
    (model / "config.pbtxt").unlink()  # the hook would complete the config
    rc, findings = validate(capsys, repo, "--disable-auto-complete-config")
    assert rc == 1 and forbidden == []  # no process: the config is missing, said so
    f = only(findings, "hook")
    assert f["file"] == str(model / "config.pbtxt") and f["message"].startswith("missing")
    assert "without --disable-auto-complete-config" in f["fix"]
    validate(capsys, repo)  # with auto-complete, the hook's process is the one started
    assert forbidden == ["subprocess.Popen"], forbidden


def test_an_auto_complete_hook_is_run_and_reported(repo, capsys):
    model = write_model(repo, "hook", python_config("hook"), HOOK_CODE)
    (model / "config.pbtxt").unlink()
    rc, findings = validate(capsys, repo)
    assert rc == 0, findings
    f = only(findings, "hook", "info")
    assert f["file"] == str(model / "1" / "model.py")
    assert "auto_complete_config" in f["message"] and "process of its own" in f["message"]
    assert "--disable-auto-complete-config" in f["fix"]
    cli.main(["validate", str(repo)])
    assert "except the auto_complete_config hooks above" in capsys.readouterr().out


def test_what_else_a_start_refuses_is_listed_with_its_line_and_a_fix(repo, capsys):
    write_model(repo, "gpu", python_config("gpu", extra="instance_group [ { kind: KIND_MODEL } ]"),
                IDENTITY_CODE)
    rc, findings = validate(capsys, repo)
    f = only(findings, "gpu")
    assert rc == 1 and f["line"] == config_line(repo, "gpu", "instance_group")
    assert "KIND_MODEL is not supported" in f["message"]
    assert f["fix"].startswith("write instance_group [ { count: 1 kind: KIND_CPU } ]")
