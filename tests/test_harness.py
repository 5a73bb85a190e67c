"""The server harness itself (shmserve_bench.harness, shared with bench/ and the soak):
a `with` block leaves nothing behind, and a parent that dies without stopping its
server still gets it stopped cleanly (PDEATHSIG -> SIGTERM)."""
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
from helpers import assert_serving, group_members, shm_entries, wait_until
from shmserve_bench.harness import ServerProcess

from shmserve.server.segments import remove_segments

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def identity_repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    helpers.copy_bundled(repo, None, names=("identity",))
    return repo


def test_with_block_serves_then_leaves_nothing(identity_repo, tmp_path):
    with ServerProcess(identity_repo, log_path=tmp_path / "server.log") as server:
        assert_serving(server.client(arena_bytes=1 << 20))
        pid, prefix, runtime = server.pid, server.prefix, server.runtime_dir
        assert server.segments() == [f"{prefix.lstrip('/')}-srv"]
        assert len(server.members()) >= 3  # coordinator, batcher, identity worker
    assert server.returncode == 0 and server.problems == []
    assert shm_entries(prefix) == [] and group_members(pid) == []
    assert not runtime.exists()  # its own runtime dir goes with it


ORPHANING_PARENT = """
import json, os, sys
from pathlib import Path
from shmserve_bench.harness import ServerProcess
server = ServerProcess(Path(sys.argv[1]), log_path=Path(sys.argv[2])).start()
print(json.dumps({"pid": server.pid, "prefix": server.prefix,
                  "runtime": str(server.runtime_dir)}), flush=True)
os.kill(os.getpid(), 9)  # dies without any teardown
"""


def test_server_of_a_killed_parent_stops_cleanly(identity_repo, tmp_path):
    log = tmp_path / "server.log"
    r = subprocess.run([sys.executable, "-c", ORPHANING_PARENT, str(identity_repo), str(log)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    info = json.loads(r.stdout)
    pid, prefix = info["pid"], info["prefix"]
    try:
        wait_until(lambda: not group_members(pid), 20, "the orphaned server's processes to exit",
                   state=lambda: group_members(pid))
        assert shm_entries(prefix) == [], "the server did not shut down cleanly"
        assert "server stopped: " in log.read_text(), log.read_text()[-2000:]
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        remove_segments(prefix)
        shutil.rmtree(info["runtime"], ignore_errors=True)
