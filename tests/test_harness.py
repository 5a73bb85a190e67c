"""The server harness itself (shmserve_bench.harness, shared with bench/ and the soak):
a `with` block leaves nothing behind, and a parent that dies without stopping its
server still gets it stopped cleanly (PDEATHSIG -> SIGTERM), set without forking the
process that starts it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
from helpers import assert_serving, group_members, wait_until
from shmserve_bench.harness import ServerProcess, with_parent_death

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def identity_repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    helpers.copy_bundled(repo, None, names=("identity",))
    return repo


def test_with_block_serves_then_leaves_nothing(identity_repo, tmp_path):
    with ServerProcess(identity_repo, log_path=tmp_path / "server.log") as server:
        assert_serving(server.client(arena_bytes=1 << 20))
        pid, runtime = server.pid, server.runtime_dir
        assert server.segments() == []  # every segment is a memfd
        assert len(server.members()) >= 3  # coordinator, batcher, identity worker
    assert server.returncode == 0 and server.problems == []
    assert group_members(pid) == []
    assert not runtime.exists()  # its own runtime dir goes with it


ORPHANING_PARENT = """
import json, os, sys
from pathlib import Path
from shmserve_bench.harness import ServerProcess
server = ServerProcess(Path(sys.argv[1]), log_path=Path(sys.argv[2])).start()
print(json.dumps({"pid": server.pid, "runtime": str(server.runtime_dir)}), flush=True)
os.kill(os.getpid(), 9)  # dies without any teardown
"""


def test_server_of_a_killed_parent_stops_cleanly(identity_repo, tmp_path):
    log = tmp_path / "server.log"
    # This tree's harness (as pytest's pythonpath), whatever an editable install points at.
    path = os.pathsep.join(filter(None, [str(helpers.REPO_ROOT / "bench"),
                                         os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", ORPHANING_PARENT, str(identity_repo), str(log)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == -signal.SIGKILL, r.stderr
    info = json.loads(r.stdout)
    pid = info["pid"]
    try:
        wait_until(lambda: not group_members(pid), 20, "the orphaned server's processes to exit",
                   state=lambda: group_members(pid))
        assert "server stopped: " in log.read_text(), "the server did not shut down cleanly\n" + \
            log.read_text()[-2000:]
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(info["runtime"], ignore_errors=True)


_forks: list[int] | None = None  # while a test watches: one entry per fork of this process


def _count_fork() -> None:
    if _forks is not None:
        _forks.append(os.getpid())


os.register_at_fork(before=_count_fork)  # for the life of the process; idle unless watched


def test_starting_a_server_does_not_fork_this_process(identity_repo, tmp_path):
    """A preexec_fn would fork() this process (subprocess uses vfork without one), and
    run grpc's fork handlers, which restart its poller thread in the child: subprocess
    closing the child's fds before exec then aborted it now and then ("epoll_wait
    error: Bad file descriptor"), in any test after one that used gRPC."""
    global _forks
    _forks = []
    try:
        with ServerProcess(identity_repo, log_path=tmp_path / "server.log") as server:
            assert_serving(server.client(arena_bytes=1 << 20))
        assert _forks == [], "the harness forked this process to start the server"
    finally:
        _forks = None


PDEATHSIG = """
import ctypes
value = ctypes.c_int()
ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
print(value.value)
"""


def test_the_command_keeps_the_parent_death_signal():
    r = subprocess.run(with_parent_death([sys.executable, "-c", PDEATHSIG], signal.SIGTERM),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == str(int(signal.SIGTERM)), r


def test_an_orphan_gets_the_signal_before_its_command(tmp_path):
    """The parent died before prctl: no signal would come, so the launcher sends it."""
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    not_the_parent = os.getppid()  # the child's parent is this process
    r = subprocess.run(with_parent_death(command, signal.SIGTERM, parent=not_the_parent),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == -signal.SIGTERM, r
    assert not marker.exists(), "the command ran although its parent was gone"
