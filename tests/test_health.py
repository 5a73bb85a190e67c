"""Issue 13: `shmserve health`, Triton's live/ready checks as exit codes (0 healthy,
1 live but not ready, 2 no server), run as a subprocess the way a Kubernetes exec
probe runs it. Each test has a server of its own (server_factory)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import BROKEN_INIT_CODE, IDENTITY_CODE, python_config, write_model

from shmserve import protocol as P
from shmserve.cli import _control_call, _control_connect


def health(server, *args: str, name: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "health", "--name",
                           name or server.name, *args],
                          capture_output=True, text=True, timeout=60, env=server.env())


def setup_broken(repo) -> None:
    write_model(repo, "broken", python_config("broken", "FP32", (-1,)), BROKEN_INIT_CODE)


def test_live_and_ready_on_a_serving_server(server_factory):
    server = server_factory(models=("identity",))
    r = health(server)
    assert r.returncode == 0, r.stderr
    assert "live" in r.stdout and len(r.stdout.splitlines()) == 1, r.stdout
    r = health(server, "--ready")
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stdout, r.stdout
    r = health(server, "--ready", "--quiet")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = health(server, "--model", "identity", "--version", "1")
    assert r.returncode == 0, r.stderr
    # no lease was opened: the server logs each lease it opens
    assert "client connected" not in server.log(), server.log()


def test_not_ready_while_a_model_is_unavailable(server_factory):
    server = server_factory(models=("identity",), setup=setup_broken)
    r = health(server)  # live all the same
    assert r.returncode == 0, r.stderr
    r = health(server, "--ready")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "broken" in r.stderr and "UNAVAILABLE" in r.stderr, r.stderr
    assert "cannot load weights" in r.stderr, r.stderr
    r = health(server, "--model", "broken")
    assert r.returncode == 1 and "broken" in r.stderr, (r.stdout, r.stderr)
    r = health(server, "--model", "identity")
    assert r.returncode == 0, r.stderr
    assert "identity" in r.stdout, r.stdout


def test_unknown_model_or_version_is_not_ready(server_factory):
    server = server_factory(models=("identity",))
    r = health(server, "--model", "no_such_model")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "no_such_model" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    r = health(server, "--model", "identity", "--version", "7")
    assert r.returncode == 1 and "7" in r.stderr, (r.stdout, r.stderr)


def test_ready_names_the_version_asked_for(server_factory):
    def setup(repo):
        write_model(repo, "two", python_config("two", "FP32", (-1,),
                                               extra="version_policy: { all: { } }"),
                    IDENTITY_CODE, versions=(1, 2))

    server = server_factory(models=(), setup=setup)
    r = health(server, "--model", "two", "--version", "1")
    assert r.returncode == 0 and "version 1" in r.stdout, (r.stdout, r.stderr)
    r = health(server, "--model", "two")  # the highest by default
    assert r.returncode == 0 and "version 2" in r.stdout, (r.stdout, r.stderr)


def test_no_server(server_factory):
    server = server_factory(models=("identity",))
    r = health(server, name=server.name + "-absent")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert server.name + "-absent" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    server.stop()
    r = health(server, "--ready")
    assert r.returncode == 2, (r.stdout, r.stderr)


def test_a_stopped_server_is_not_waited_for_past_the_timeout(server_factory):
    """A coordinator that accepts nothing (SIGSTOP: its socket still listens, the
    kernel queues the connection) is reported as no server once --timeout is spent."""
    server = server_factory(models=("identity",))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        r = health(server, "--timeout", "0.5")
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "did not answer" in r.stderr, r.stderr
    assert health(server).returncode == 0


def setup_broken_config(repo) -> None:
    write_model(repo, "bad_pbtxt", 'name: "bad_pbtxt"\nbackend: "python"\nmax_batch_size: eight\n',
                IDENTITY_CODE)


@pytest.mark.parametrize("strict, ready", [("true", False), ("false", True)])
def test_strict_readiness(server_factory, strict, ready):
    """Triton's --strict-readiness: true (the default), the server is ready only while
    every model is READY; false, as soon as it serves ("ready as soon as it's live").
    A model's own readiness does not change."""
    server = server_factory(models=("identity",), setup=setup_broken_config,
                            args=["--exit-on-error=false", f"--strict-readiness={strict}"])
    assert health(server).returncode == 0  # live either way
    r = health(server, "--ready")
    if ready:
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "is ready (--strict-readiness=false" in r.stdout, r.stdout
        assert "'bad_pbtxt'" in r.stdout and "UNAVAILABLE" in r.stdout, r.stdout
    else:
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "'bad_pbtxt'" in r.stderr and "UNAVAILABLE" in r.stderr, r.stderr
    assert health(server, "--model", "bad_pbtxt").returncode == 1
    assert health(server, "--model", "identity").returncode == 0
    # the control socket's answer that `health --ready` reads
    sock = _control_connect(server.name, 5.0)
    try:
        reply = _control_call(sock, P.ListModels(), time.monotonic() + 5.0, server.name)
    finally:
        sock.close()
    assert reply.ready is ready
    assert {m["name"]: m["state"] == "READY" for m in reply.models} == \
        {"identity": True, "bad_pbtxt": False}
