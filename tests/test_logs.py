"""The server's log: Triton's flags (--log-verbose, --log-info/-warning/-error,
--log-format, --log-file), one line per lifecycle event, and a python model's output
as log lines naming it. Real servers throughout; the lines are read back from their
stderr or their --log-file."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import BROKEN_INIT_CODE, assert_serving, python_config, wait_until, write_model

from shmserve import cli
from shmserve.logs import LogOptions
from shmserve.server import coordinator

pytestmark = pytest.mark.timeout(90)

WHERE = r"(\d+) (coordinator|batcher|worker)/([\w.]+):(\d+)\] (.*)"
LINE = {"default": re.compile(r"([IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} " + WHERE),
        "ISO8601": re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ([IWE]) " + WHERE)}

PRINTER_CODE = """
import sys


class TritonPythonModel:
    def initialize(self, args):
        print("hello from initialize")
        print("and a line on stderr", file=sys.stderr)

    def execute(self, inputs):
        print("executing a batch of", len(inputs["INPUT0"]))
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def with_printer(repo):
    write_model(repo, "printer", python_config("printer"), PRINTER_CODE)


def with_broken(repo):
    write_model(repo, "broken", python_config("broken"), BROKEN_INIT_CODE)


def parse(text: str, fmt: str = "default") -> list[tuple]:
    """(severity, pid, role, file, line, message) of every line; fails on a line that
    is not one whole record in the format (two records cut into each other)."""
    rows = []
    for line in text.splitlines():
        m = LINE[fmt].fullmatch(line)
        assert m, f"not a {fmt} log line: {line!r}\n--- log ---\n{text}"
        rows.append((m[1], int(m[2]), m[3], m[4], int(m[5]), m[6]))
    return rows


def the_one(pattern: str, text: str) -> re.Match:
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, f"{len(found)} lines match {pattern!r}:\n{text}"
    return re.search(pattern, text, re.M)


# -- flags ---------------------------------------------------------------------------

def serve_options(monkeypatch, *flags) -> coordinator.ServeOptions:
    """The ServeOptions `shmserve serve FLAGS` would run a server with."""
    seen = []
    monkeypatch.setattr(coordinator, "run", lambda opts: seen.append(opts) or 0)
    assert cli.main(["serve", "--model-repository", "repo", *flags]) == 0
    return seen[0]


def test_log_flags_default_to_tritons(monkeypatch):
    assert serve_options(monkeypatch).log_options() == LogOptions(
        verbose=0, info=True, warning=True, error=True, format="default", file=None)


def test_log_flags_in_tritons_spellings(monkeypatch, tmp_path):
    opts = serve_options(monkeypatch, "--log-verbose=2", "--log-info=false", "--log-warning",
                         "0", "--log-error=false", "--log-format=ISO8601",
                         "--log-file", str(tmp_path / "server.log"))
    assert opts.log_options() == LogOptions(verbose=2, info=False, warning=False, error=False,
                                            format="ISO8601", file=str(tmp_path / "server.log"))
    monkeypatch.chdir(tmp_path)  # a relative --log-file is where serve was started
    assert serve_options(monkeypatch, "--log-file", "rel.log").log_options().file == str(
        tmp_path / "rel.log")


@pytest.mark.parametrize("level, expect", [
    ("debug", dict(verbose=1)), ("INFO", {}), ("warning", dict(info=False)),
    ("error", dict(info=False, warning=False))])
def test_log_level_is_a_shorthand_for_the_triton_flags(monkeypatch, level, expect):
    assert serve_options(monkeypatch, "--log-level", level).log_options() == LogOptions(**expect)


def test_log_level_and_triton_flags_combine(monkeypatch):
    """Either turns a severity off; either turns verbose lines on."""
    opts = serve_options(monkeypatch, "--log-level", "warning", "--log-info=true",
                         "--log-verbose", "1").log_options()
    assert (opts.info, opts.verbose) == (False, 1)
    opts = serve_options(monkeypatch, "--log-level", "debug", "--log-verbose", "0",
                         "--log-warning=false").log_options()
    assert (opts.verbose, opts.info, opts.warning) == (1, True, False)


@pytest.mark.parametrize("flag, value, why", [
    ("--log-verbose", "-1", "'-1' is not a verbose level"),
    ("--log-verbose", "loud", "'loud' is not a verbose level"),
    ("--log-info", "maybe", "'maybe' is not a boolean"),
    ("--log-warning", "2", "'2' is not a boolean"),
    ("--log-format", "json", "'json' is not a log format (default, ISO8601)"),
    ("--log-level", "chatty", "'chatty' is not a log level (debug, info, warning, error)")])
def test_bad_log_flag_values_are_refused(monkeypatch, capsys, flag, value, why):
    monkeypatch.setattr(coordinator, "run", lambda opts: pytest.fail("served with a bad flag"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model-repository", "repo", f"{flag}={value}"])
    assert e.value.code == 2
    assert f"argument {flag}: {why}" in capsys.readouterr().err


def test_log_file_that_cannot_be_opened_is_refused(tmp_path):
    path = tmp_path / "no-such-dir" / "server.log"
    r = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                        str(tmp_path), "--name", f"logs{os.getpid()}", "--log-file", str(path)],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                       env={**os.environ, "SHMSERVE_RUNTIME_DIR": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert f"--log-file {path}: cannot open it for appending: No such file" in r.stderr, r.stderr
    parse(r.stderr)  # said in the log's own format


# -- lines from every process, in the chosen format, into --log-file -------------------

@pytest.mark.parametrize("fmt", ["default", "ISO8601"])
def test_log_file_gets_every_process_in_the_format(server_factory, tmp_path, fmt):
    """Coordinator, batcher and worker append to one file, each record whole; the
    model's prints are lines naming it, at the line of the print; verbose lines show."""
    path = tmp_path / "server.log"
    server = server_factory(models=("identity",), setup=with_printer, args=[
        "--log-file", str(path), "--log-format", fmt, "--log-verbose", "1"])
    with server.client(arena_bytes=1 << 20) as c:
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(c.infer("printer", [x])["OUTPUT0"], x)
        wait_until(lambda: "executing a batch of 1" in path.read_text(), 10,
                   "the model's print in the log file")
    assert cli.check_health(server.name)[0] == cli.HEALTHY  # a connection without a lease
    assert server.stop() == 0
    text = path.read_text()
    rows = parse(text, fmt)
    assert os.stat(path).st_mode & 0o777 == 0o600
    roles = {role: {pid for _, pid, r, *_ in rows if r == role} for role in
             ("coordinator", "batcher", "worker")}
    assert roles["coordinator"] == {server.pid}, text
    assert roles["batcher"] and len(roles["worker"]) == 2, text  # printer's and identity's

    said = {msg: (sev, role, file, line) for sev, _, role, file, line, msg in rows}
    who = "model 'printer' version 1 instance 0"
    assert said[f"{who}: hello from initialize"] == ("I", "worker", "model.py", 7), text
    assert said[f"{who}: and a line on stderr"] == ("W", "worker", "model.py", 8), text
    assert said[f"{who}: executing a batch of 1"] == ("I", "worker", "model.py", 11), text
    assert any(m.startswith("batcher serving: ") for m in said), text  # verbose, batcher
    assert any(m.startswith("control connection opened: ") for m in said), text  # verbose
    assert "model loaded: 'printer' version 1, 1 instance in" in text
    assert not any(LINE[f].search(server.log()) for f in LINE), server.log()  # none on stderr


# -- one line per lifecycle event --------------------------------------------------------

def test_lifecycle_lines(server_factory):
    server = server_factory(models=("identity",), setup=with_broken)
    name, me = server.name, f"pid {os.getpid()}, uid {os.getuid()}"
    # the harness sees the server ready at its socket, a moment before its log line
    log = wait_until(lambda: text if "] server ready: " in (text := server.log()) else None,
                     20, "the server's ready line")
    the_one(rf"\] server starting: '{name}', repository {re.escape(str(server.repo))}, "
            rf"pid {server.pid}$", log)
    the_one(r"\] model loading: 'identity' version 1 \(python backend, 1 instance, "
            r"max_batch_size \d+\)$", log)
    the_one(r"\] model loaded: 'identity' version 1, 1 instance in \d+\.\d\d s$", log)
    the_one(r"^E.*\] model failed to load: 'broken' version 1 \(instance 0\): "
            r"RuntimeError: cannot load weights$", log)
    the_one(rf"\] server ready: '{name}', control socket {re.escape(str(server.socket_path))}, "
            r"1 of 2 models READY$", log)
    worker = int(the_one(r"\] worker started: model 'identity' version 1 instance 0, "
                         r"pid (\d+)$", log)[1])
    batcher = int(the_one(r"\] batcher started: pid (\d+)$", log)[1])

    c = server.client(arena_bytes=1 << 20)
    the_one(rf"\] client connected: id {c.client_id}, {me} \(lease \d+, 1\.0 MiB arena\)$",
            server.log())

    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: "worker restarted: " in server.log(), 20, "the worker's restart")
    log = server.log()
    the_one(rf"^E.*\] worker exited: model 'identity' version 1 instance 0, pid {worker}, "
            r"signal SIGKILL; restart 1 in \d\.\d s$", log)
    new_worker = int(the_one(r"\] worker restarted: model 'identity' version 1 instance 0, "
                             r"pid (\d+) \(restart 1\)$", log)[1])
    assert new_worker != worker
    assert_serving(c)

    os.kill(batcher, signal.SIGKILL)
    wait_until(lambda: "batcher restarted: " in server.log(), 20, "the batcher's restart")
    the_one(rf"^E.*\] batcher exited: pid {batcher}, signal SIGKILL; restart 1", server.log())
    the_one(r"\] batcher restarted: pid \d+ \(restart 1\)$", server.log())
    assert_serving(c)

    c.close()
    wait_until(lambda: "client disconnected" in server.log(), 10, "the disconnect line")
    the_one(rf"\] client disconnected: id {c.client_id}, {me}: the client closed its "
            r"connection or exited$", server.log())

    assert server.stop(signal.SIGTERM) == 0
    log = server.log(10**6)
    rows = parse(log)
    assert not any(m.startswith(("batcher serving", "control connection")) for *_, m in rows)
    the_one(rf"\] server stopping: '{name}' \(SIGTERM\)$", log)
    # a worker leaves its loop on the stop's SIGTERM and runs finalize(): exit code 0
    the_one(rf"\] worker exited: model 'identity' version 1 instance 0, pid {new_worker}, "
            r"exit code 0$", log)
    the_one(r"\] model unloaded: 'identity' version 1$", log)
    assert "model unloaded: 'broken'" not in log  # it never loaded
    the_one(rf"\] server stopped: '{name}', segments removed$", log)
    assert log.rstrip().endswith(f"server stopped: '{name}', segments removed")


def test_log_info_false_leaves_warnings_and_errors(server_factory):
    server = server_factory(models=("identity",), setup=with_broken, args=["--log-info=false"])
    with server.client(arena_bytes=1 << 20) as c:
        assert_serving(c)
    assert server.stop() == 0
    rows = parse(server.log())
    assert rows and "I" not in {sev for sev, *_ in rows}, server.log()
    assert any(m.startswith("model failed to load: 'broken' version 1") for *_, m in rows)
