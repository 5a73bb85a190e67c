"""Server lifetime: clean shutdown, stop and crash seen by callers, name conflicts,
no /dev/shm space, bad repositories, worker crashes. Each test has servers of its own."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    CRASHER_CODE,
    SLEEPER_CODE,
    assert_serving,
    python_config,
    wait_in_flight,
    wait_until,
    write_model,
)

import helpers
import shmserve
from shmserve import errors
from shmserve.protocol import LAYOUT, ClientState, SlotState
from shmserve.server.segments import ServerLayout, mem_available_bytes

pytestmark = pytest.mark.timeout(60)


def with_sleeper(repo):
    write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
                SLEEPER_CODE)


def with_crasher(repo):
    write_model(repo, "crasher", python_config("crasher", "FP32", (-1,), dynamic_batching=None),
                CRASHER_CODE)


def serve_cli(repo, name, *args, timeout=60) -> subprocess.CompletedProcess:
    """Runs `shmserve serve` expecting it to exit by itself (a refused start)."""
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                           str(repo), "--name", name, *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def sleep_request(client, seconds: float, timeout=None):
    return client.infer("sleeper", [np.array([[seconds]], np.float32)], timeout=timeout)


# ---------------------------------------------------------------- clean shutdown

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_leaves_nothing(server_factory, sig):
    server = server_factory(setup=with_sleeper)
    c1, c2 = server.client(arena_bytes=1 << 20), server.client(arena_bytes=2 << 20)
    held = c1.infer("identity", [np.ones((1, 8), np.float32)])  # a live view at shutdown
    assert helpers.shm_files(server.members()) == []  # every segment is a memfd
    assert len(server.arenas()) == 2, server.arenas()  # one per client
    assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.runtime_dir.stat().st_mode) == 0o700
    assert len(server.members()) >= 4  # coordinator, batcher, identity and sleeper workers

    assert server.stop(sig) == 0
    wait_until(lambda: not server.members(), 5, "the server's processes to exit",
               state=server.members)
    assert not server.socket_path.exists() and not server.record_path.exists()
    np.testing.assert_array_equal(held["OUTPUT0"], 1)  # still readable: the mapping lives on
    with pytest.raises(errors.ServerDeadError):
        c2.infer("identity", [np.ones((1, 8), np.float32)])


def test_shutdown_with_connected_client_logs_no_traceback(server_factory):
    server = server_factory()
    c = server.client(arena_bytes=1 << 20)
    assert_serving(c)
    assert server.stop() == 0
    assert "Traceback" not in server.log(), server.log()


def test_request_after_server_stopped(server_factory):
    server = server_factory()
    c = server.client(arena_bytes=1 << 20)
    assert_serving(c)
    assert server.stop() == 0
    with pytest.raises(errors.ServerDeadError, match="stopped"):
        c.infer("identity", [np.ones((1, 8), np.float32)])
    with pytest.raises(errors.ServerDeadError, match="stopped"):
        c.submit("identity", [np.ones((1, 8), np.float32)])
    with pytest.raises(errors.ServerDeadError, match=server.name):
        shmserve.Client(server.name)


def test_request_in_flight_past_the_exit_timeout(server_factory):
    """A stop waits --exit-timeout-secs for requests in flight; those still running
    after it are answered as a dead server (the caller never hangs)."""
    server = server_factory(setup=with_sleeper, args=["--exit-timeout-secs", "1"])
    c = server.client(arena_bytes=1 << 20)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(sleep_request, c, 30.0)
        future = c.submit("sleeper", [np.array([[30.0]], np.float32)])
        wait_in_flight(server, c, SlotState.RUNNING, SlotState.QUEUED)
        assert not waiting.done()
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(errors.ServerDeadError):
            waiting.result(timeout=15)
        with pytest.raises(errors.ServerDeadError):
            future.result(timeout=15)
    assert server.proc.wait(15) == 0


def test_stop_drains_requests_in_flight(server_factory):
    """SIGTERM lets the requests the server holds finish (one running, one queued
    behind it) and refuses new ones while it drains, then stops cleanly."""
    server = server_factory(setup=with_sleeper)  # default --exit-timeout-secs: 30
    c = server.client(arena_bytes=1 << 20)
    running = c.submit("sleeper", [np.array([[1.0]], np.float32)])
    queued = c.submit("sleeper", [np.array([[0.25, 7.0]], np.float32)])
    wait_in_flight(server, c, SlotState.RUNNING, SlotState.QUEUED)
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "in flight, waiting" in server.log(), 10, "the server to start draining")
    with pytest.raises(errors.UnavailableError, match="stopping"):
        c.infer("identity", [np.ones((1, 4), np.float32)], timeout=10)
    np.testing.assert_array_equal(running.result(timeout=20)["OUTPUT0"], [[1.0]])
    np.testing.assert_array_equal(queued.result(timeout=20)["OUTPUT0"], [[0.25, 7.0]])
    assert server.proc.wait(20) == 0
    assert "unanswered" not in server.log(), server.log()


# ---------------------------------------------------------------- crashes

def test_server_sigkilled_while_client_waits(server_factory):
    server = server_factory(setup=with_sleeper)
    name = server.name
    c = server.client(arena_bytes=1 << 20)
    children = [p for p in server.members() if p != server.pid]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(sleep_request, c, 30.0)
        wait_in_flight(server, c, SlotState.RUNNING)
        server.kill()
        server.proc.wait(10)  # reaped, as any supervisor would
        with pytest.raises(errors.ServerDeadError, match=server.name):
            waiting.result(timeout=15)  # an error, not a hang
    with pytest.raises(errors.ServerDeadError):
        c.infer("identity", [np.ones((1, 4), np.float32)])
    # Its children die with it (PDEATHSIG); its segments, all memfds, went with the
    # processes: nothing was left in /dev/shm to clean.
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in children),
               5, "the server's children to die with it")

    # The next start of the same name serves.
    again = server_factory(setup=with_sleeper, name=name)
    assert_serving(again.client(arena_bytes=1 << 20))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_server_sigkilled_not_yet_reaped(server_factory):
    """A zombie server (dead, not reaped by its parent: here the test process)
    must not pass for a live one: the waiting caller gets ServerDeadError."""
    server = server_factory(setup=with_sleeper)
    c = server.client(arena_bytes=1 << 20)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(sleep_request, c, 30.0, timeout=4)
            wait_in_flight(server, c, SlotState.RUNNING)
            server.kill()  # not reaped: the test process is the server's parent
            with pytest.raises(errors.ServerDeadError):
                waiting.result(timeout=15)
    finally:
        server.proc.wait(10)


def test_worker_crash_answers_its_inflight_request(server_factory):
    server = server_factory(setup=with_crasher)
    c = server.client(arena_bytes=1 << 20)
    with pytest.raises(errors.ShmServeError) as e:
        c.infer("crasher", [np.array([[-1.0]], np.float32)], timeout=20)
    assert not isinstance(e.value, errors.ServerTimeoutError), e.value
    assert "'crasher'" in e.value.msg
    assert_serving(c)  # other models were not affected


def test_worker_restarted_after_crash_serves_again(server_factory):
    """The coordinator restarts a dead worker, and the model serves again."""
    server = server_factory(setup=with_crasher)
    c = server.client(arena_bytes=1 << 20)
    c.submit("crasher", [np.array([[-1.0]], np.float32)])
    x = np.array([[1.0, 2.0]], np.float32)
    deadline = time.monotonic() + 8
    while True:
        try:
            np.testing.assert_array_equal(c.infer("crasher", [x], timeout=2)["OUTPUT0"], x)
            return
        except errors.ShmServeError:
            if time.monotonic() > deadline:
                raise


RETRY = 'parameters { key: "shmserve.retry_on_worker_crash" value { string_value: "true" } }'
FLAKY_CODE = '''
import os

class TritonPythonModel:
    def execute(self, inputs):
        marker = {marker!r}
        if not os.path.exists(marker):  # the first execution ever dies mid-batch
            open(marker, "w").close()
            os._exit(9)
        return {{"OUTPUT0": inputs["INPUT0"].copy()}}
'''


def test_retry_safe_model_reruns_the_batch_of_a_dead_worker(server_factory, tmp_path):
    """retry_on_worker_crash: the restarted worker runs the batch again; the caller
    gets its answer, not an error."""
    marker = tmp_path / "died-once"

    def setup(repo):
        write_model(repo, "flaky", python_config("flaky", "FP32", (-1,), dynamic_batching=None,
                                                 extra=RETRY), FLAKY_CODE.format(marker=str(marker)))
    server = server_factory(setup=setup)
    c = server.client(arena_bytes=1 << 20)
    x = np.array([[1.0, 2.0, 3.0]], np.float32)
    np.testing.assert_array_equal(c.infer("flaky", [x], timeout=30)["OUTPUT0"], x)
    assert marker.exists()  # it did die once
    assert "re-running the batch" in server.log(4000)


def test_retry_safe_model_fails_a_batch_that_kills_twice(server_factory):
    """A batch that kills its worker again on the re-run is answered with an error:
    one retry, never a loop."""
    def setup(repo):
        write_model(repo, "crasher", python_config("crasher", "FP32", (-1,), dynamic_batching=None,
                                                   extra=RETRY), CRASHER_CODE)
    server = server_factory(setup=setup)
    c = server.client(arena_bytes=1 << 20)
    with pytest.raises(errors.UnavailableError, match="died again"):
        c.infer("crasher", [np.array([[-1.0]], np.float32)], timeout=30)
    assert_serving(c)


def test_retry_parameter_must_be_a_boolean(tmp_path):
    from shmserve.errors import ConfigError
    from shmserve.server.repository import load_repository

    write_model(tmp_path, "m", python_config("m", extra=RETRY.replace('"true"', '"sometimes"')),
                CRASHER_CODE)
    with pytest.raises(ConfigError, match="shmserve.retry_on_worker_crash"):
        load_repository(tmp_path)


# ---------------------------------------------------------------- refused starts

def test_unknown_group_is_refused(server_factory):
    server = server_factory(start=False)
    result = serve_cli(server.repo, server.name, "--group", "no-such-group-shms")
    assert result.returncode == 2 and "--group 'no-such-group-shms': no such group" in result.stderr
    assert not server.socket_path.exists()


def test_second_server_with_same_name_is_refused(server_factory):
    first = server_factory()
    c = first.client(arena_bytes=1 << 20)
    second = serve_cli(first.repo, first.name)
    assert second.returncode == 2, second.stderr
    assert "already running" in second.stderr and first.name in second.stderr
    assert str(first.pid) in second.stderr
    assert first.running()
    assert_serving(c)  # an existing client is not disturbed
    assert helpers.open_memfds(first.pid, "shmserve-server")


def test_first_server_reachable_after_name_conflict(server_factory):
    first = server_factory()
    assert serve_cli(first.repo, first.name).returncode == 2
    assert_serving(first.client(arena_bytes=1 << 20))


def test_no_memory_for_server_segment(server_factory, tmp_path):
    """--max-clients x --slots-per-client beyond the memory available: exit 2, clear
    message naming the flags, nothing left behind."""
    slots = 1024
    shadows = ServerLayout(1, slots, 1, 1).size  # about one client's share of the segment
    clients = 2 * mem_available_bytes() // shadows  # twice MemAvailable: refused before any allocation
    server = server_factory(args=["--max-clients", str(clients), "--slots-per-client",
                                  str(slots)], start=False)
    result = serve_cli(server.repo, server.name, *server.args)
    assert result.returncode == 2, result.stderr
    assert "not enough space in memory for the server segment" in result.stderr and \
        "--max-clients" in result.stderr, result.stderr
    assert not server.record_path.exists() and not server.socket_path.exists()


def _server_children(server) -> dict[int, str]:
    """{pid: "batcher" or the worker's model} of a server's children."""
    found = {}
    for pid in helpers.children_of(server.pid):
        argv = helpers.cmdline(pid)
        if "shmserve.server.batcher" in argv:
            found[pid] = "batcher"
        elif "shmserve.server.worker" in argv:
            found[pid] = "worker"
    return found


def test_server_segment_is_an_inherited_memfd(server_factory):
    """No process of a serving server holds or maps anything in /dev/shm: the
    server-private segment is a memfd the coordinator holds and the batcher and the
    workers inherit, restarted ones (after SIGKILL) included, which then serve."""
    server = server_factory()
    c = server.client(arena_bytes=1 << 20)
    assert_serving(c)
    assert helpers.shm_files(server.members()) == []
    assert helpers.open_memfds(server.pid, "shmserve-server")
    before = _server_children(server)
    assert sorted(before.values()) == ["batcher", "worker"], before
    for pid in before:
        assert helpers.maps_memfd(pid, "shmserve-server"), pid
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: sorted(_server_children(server).values()) == ["batcher", "worker"]
               and not set(_server_children(server)) & set(before), 20,
               "a new batcher and a new worker", state=lambda: _server_children(server))
    assert_serving(c)
    for pid in _server_children(server):
        assert helpers.maps_memfd(pid, "shmserve-server"), pid
    assert helpers.shm_files(server.members()) == []


BAD_CONFIGS = {
    "syntax": ('name: "bad"\nbackend: "python"\nmax_batch_size: eight\n',
               r"config\.pbtxt:3:\d+"),
    "unknown_field": ('name: "bad"\nbackend: "python"\nmax_batch: 4\n',
                      r"config\.pbtxt:3:\d+.*max_batch"),
    "backend": ('name: "bad"\nbackend: "tensorflow"\nmax_batch_size: 1\n'
                'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
                r"config\.pbtxt: backend 'tensorflow' is not supported"),
    "name_mismatch": ('name: "other"\nbackend: "python"\nmax_batch_size: 1\n'
                      'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                      'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
                      r"config\.pbtxt: name 'other' differs from its directory 'bad'"),
    "instance_kind": ('name: "bad"\nbackend: "python"\nmax_batch_size: 1\n'
                      'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                      'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                      'instance_group [ { kind: KIND_MODEL } ]\n',
                      r"config\.pbtxt: instance_group kind KIND_MODEL is not supported"),
    "dynamic_batching_unbatched": ('name: "bad"\nbackend: "python"\nmax_batch_size: 0\n'
                                   'input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                                   'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                                   'dynamic_batching { }\n',
                                   r"config\.pbtxt: dynamic_batching needs max_batch_size > 0"),
    "zero_dim": ('name: "bad"\nbackend: "python"\nmax_batch_size: 1\n'
                 'input [ { name: "I" data_type: TYPE_FP32 dims: [ 0 ] } ]\n'
                 'output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
                 r"config\.pbtxt: input 'I' dims \[0\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_refused(tmp_path, monkeypatch, case):
    import re

    text, pattern = BAD_CONFIGS[case]
    repo = tmp_path / "repo"
    write_model(repo, "bad", text, "class TritonPythonModel:\n    pass\n")
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("SHMSERVE_RUNTIME_DIR", str(runtime))
    result = serve_cli(repo, f"bad-{case}")
    assert result.returncode == 2, result.stderr
    assert str(repo / "bad" / "config.pbtxt") in result.stderr
    assert re.search(pattern, result.stderr), result.stderr
    assert os.listdir(runtime) == []  # no socket, no record: nothing was started


def test_runtime_dir_must_be_private(tmp_path, monkeypatch):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    monkeypatch.setenv("SHMSERVE_RUNTIME_DIR", str(runtime))
    repo = tmp_path / "repo"
    write_model(repo, "m", python_config("m"), "class Model:\n    pass\n")
    result = serve_cli(repo, "private")
    assert result.returncode != 0
    assert "0700" in result.stderr
    assert os.listdir(runtime) == []


HANGING_CODE = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(600)

    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def test_model_that_never_loads_is_unavailable_not_a_hung_start(server_factory):
    """--load-timeout bounds start-up: a model whose initialize() hangs is reported
    UNAVAILABLE with the reason, and the other models are served."""
    def setup(repo):
        helpers.write_model(repo, "hangs", helpers.python_config("hangs"), HANGING_CODE)

    server = server_factory(models=("identity",), setup=setup, args=["--load-timeout", "6"])
    with server.client() as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["identity"] == "READY"
        assert "did not load within 6 s" in states["hangs"], states
        with pytest.raises(errors.UnavailableError, match="'hangs'"):
            c.infer("hangs", [np.ones((1, 2), np.float32)], timeout=10)
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(c.infer("identity", [x])["OUTPUT0"], x)


def _batcher_pid(server) -> int:
    for pid in helpers.children_of(server.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"shmserve.server.batcher" in f.read():
                return pid
    raise AssertionError("no batcher process")


def test_batcher_crash_loses_no_queued_request(server_factory):
    """kill -9 of the batcher while it holds a queued request: the coordinator
    restarts it, the new batcher takes the request again, and every caller gets its
    own answer (nothing hangs, nothing is answered twice)."""
    def setup(repo):
        write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
                    SLEEPER_CODE)

    server = server_factory(models=("identity",), setup=setup)
    c = server.client(arena_bytes=1 << 20)
    busy = c.submit("sleeper", [np.array([[1.0]], np.float32)])  # the worker sleeps 1 s
    wait_in_flight(server, c, SlotState.RUNNING)
    queued = c.submit("sleeper", [np.array([[0.0, 7.0]], np.float32)])  # waits in the batcher
    wait_in_flight(server, c, SlotState.RUNNING, SlotState.QUEUED)
    old = _batcher_pid(server)
    os.kill(old, signal.SIGKILL)
    np.testing.assert_array_equal(busy.result(timeout=20)["OUTPUT0"], [[1.0]])
    np.testing.assert_array_equal(queued.result(timeout=20)["OUTPUT0"], [[0.0, 7.0]])
    wait_until(lambda: _batcher_pid(server) != old, 10, "a new batcher process")
    assert "recovered 1 request" in server.log(), server.log(2000)
    assert_serving(c)


CRASH_LOOP_CODE = '''
import os
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        marker = Path(__file__).with_name("loaded-once")
        if marker.exists():  # every restart dies while loading
            os._exit(1)
        marker.write_text("")

    def execute(self, inputs):
        os._exit(1)
'''


def test_crash_looping_model_becomes_unavailable(server_factory):
    """A worker that keeps dying is retired after 5 exits in 60 s: the request it
    held is answered, the model turns UNAVAILABLE with the reason, later requests are
    refused at once, and the other models never notice."""
    def setup(repo):
        write_model(repo, "crashloop", python_config("crashloop", "FP32", (-1,)), CRASH_LOOP_CODE)

    server = server_factory(models=("identity",), setup=setup)
    c = server.client(arena_bytes=1 << 20)
    with pytest.raises(errors.UnavailableError, match="'crashloop'"):
        c.infer("crashloop", [np.ones((1, 2), np.float32)], timeout=60)

    def state():
        return {m["name"]: m["state"] for m in c.models()}["crashloop"]

    wait_until(lambda: "crashed 5 times" in state(), 30, "crashloop to be retired", state=state)
    with pytest.raises(errors.UnavailableError, match="'crashloop'"):
        c.infer("crashloop", [np.ones((1, 2), np.float32)], timeout=10)
    assert "retired" in server.log(), server.log(2000)
    assert_serving(c)


def test_mapping_of_an_ended_lease_stays_until_dropped_between_batches(main_server, make_client):
    """ServerMaps.arena() answers None once a lease ended but never unmaps: a request
    of the batch in hand (or of a queue) may still use the mapping. The unmapping waits
    for drop_ended_leases, which the worker and the batcher call between batches."""
    from shmserve.segments import Segment
    from shmserve.server.maps import ServerMaps

    pid = main_server.pid
    control = next(f"/proc/{pid}/fd/{fd.name}" for fd in Path(f"/proc/{pid}/fd").iterdir()
                   if os.readlink(fd).startswith("/memfd:shmserve-control"))
    bell = helpers.memfd_path(pid, "shmserve-bell")
    server_segment = helpers.memfd_path(pid, "shmserve-server")
    srv = Segment.open_path(server_segment, LAYOUT["server.size"])
    try:
        max_clients, slots, n_models, n_workers = (
            srv.ops.load32(LAYOUT[f"server.{f}"])
            for f in ("max_clients", "slots_per_client", "n_models", "n_workers"))
    finally:
        srv.close()
    maps = ServerMaps({"max_clients": max_clients, "slots_per_client": slots,
                       "n_models": n_models, "n_workers": n_workers,
                       "control_fd": os.open(control, os.O_RDWR | os.O_CLOEXEC),
                       "control_bytes": os.stat(control).st_size,
                       "bell_fd": os.open(bell, os.O_RDWR | os.O_CLOEXEC),
                       "bell_bytes": os.stat(bell).st_size,
                       "server_fd": os.open(server_segment, os.O_RDWR | os.O_CLOEXEC),
                       "spin_us": 0, "max_spin_us": 0,
                       "coordinator_pid": pid})
    c = make_client(arena_bytes=1 << 20)
    state, lease = maps.lease_of(c.client_id)
    seg, _ = maps.arena(c.client_id, lease)
    c.close()
    wait_until(lambda: maps.lease_of(c.client_id)[0] != ClientState.ALIVE, 10,
               "the closed client's lease to end")
    assert maps.arena(c.client_id, lease) is None
    assert seg.ops is not None and seg.ops.load64(0) == LAYOUT["MAGIC_ARENA"]  # still usable
    maps.drop_ended_leases()
    assert seg.ops is None


PRINTING_CODE = """
import sys


class TritonPythonModel:
    def initialize(self, args):
        print("hello from initialize")  # stdout: the log, not the load handshake
        print("and a line on stderr", file=sys.stderr)

    def execute(self, inputs):
        print("executing a batch of", len(inputs["INPUT0"]))
        return {"OUTPUT0": inputs["INPUT0"]}
"""


def test_model_prints_go_to_the_log_not_the_handshake(server_factory):
    """A print() in initialize() used to be read as the worker's load report: the
    start hung forever. Model output now lands in the server's log."""
    def setup(repo):
        helpers.write_model(repo, "printer", helpers.python_config("printer"), PRINTING_CODE)

    server = server_factory(models=("identity",), setup=setup)
    with server.client() as c:
        assert {m["name"]: m["state"] for m in c.models()}["printer"] == "READY"
        x = np.ones((1, 3), np.float32)
        np.testing.assert_array_equal(c.infer("printer", [x])["OUTPUT0"], x)
    wait_until(lambda: "executing a batch of 1" in server.log(), 10, "the model's print in the log")
    log = server.log()
    assert "hello from initialize" in log and "and a line on stderr" in log, log


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT, signal.SIGTERM])
def test_every_stop_signal_stops_cleanly(server_factory, sig):
    server = server_factory(models=("identity",))
    with server.client() as c:
        assert_serving(c)
    assert server.stop(sig) == 0
    assert server.members() == []
    assert "Traceback" not in server.log(), server.log()


def test_stop_signal_while_a_model_loads_cleans_up(server_factory):
    """SIGTERM while a model hangs in initialize(): the server stops its children and
    removes its segments (the default action of the signal used to kill it first)."""
    def setup(repo):
        helpers.write_model(repo, "hangs", helpers.python_config("hangs"), HANGING_CODE)

    server = server_factory(models=(), setup=setup, args=["--load-timeout", "600"], start=False)
    with pytest.raises(RuntimeError, match="not ready"):
        server.start(timeout=3)  # the model hangs: no control socket yet
    wait_until(lambda: helpers.open_memfds(server.pid, "shmserve-server"), 10,
               "the server's segment")
    assert server.stop(signal.SIGTERM) == 0
    assert server.members() == []
    assert "while starting: stopping" in server.log(), server.log()


FINALIZER_CODE = '''
import os


class TritonPythonModel:
    def initialize(self, args):
        self.mark = os.path.join(args["model_repository"], "finalized")

    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}

    def finalize(self):
        with open(self.mark, "w") as f:
            f.write("done")
'''


def test_stop_runs_the_models_finalize(server_factory, tmp_path):
    """The coordinator's stop lets each worker leave its loop and call finalize(), as
    Triton's unload does (SIGTERM no longer kills a worker mid-way)."""
    server = server_factory(setup=lambda repo: write_model(
        repo, "finalizer", python_config("finalizer", "FP32", (-1,)), FINALIZER_CODE))
    c = server.client(arena_bytes=1 << 20)
    c.infer("finalizer", [np.ones((1, 4), np.float32)])
    mark = server.repo / "finalizer" / "finalized"
    assert not mark.exists()
    assert server.stop(signal.SIGTERM) == 0
    assert mark.read_text() == "done"


def test_a_crash_in_finalize_is_logged_and_the_stop_completes(server_factory):
    code = FINALIZER_CODE.replace('''        with open(self.mark, "w") as f:
            f.write("done")''', '''        raise RuntimeError("cannot release the weights")''')
    server = server_factory(setup=lambda repo: write_model(
        repo, "bad_finalizer", python_config("bad_finalizer", "FP32", (-1,)), code))
    c = server.client(arena_bytes=1 << 20)
    c.infer("bad_finalizer", [np.ones((1, 4), np.float32)])
    assert server.stop(signal.SIGTERM) == 0
    log = server.log(10**6)
    assert ("model 'bad_finalizer' version 1 instance 0: finalize raised RuntimeError: "
            "cannot release the weights") in log, log
    assert "worker exited: model 'bad_finalizer' version 1 instance 0" in log and \
        "exit code 4" in log, log


def test_only_the_grpc_front_loads_grpc(server_factory):
    """Triton's config schema is loaded without tritonclient.grpc's package (which
    imports grpc): grpc would cost every process start a third of a second and put its
    fork handlers into processes that never speak gRPC (shmserve/model_config.py)."""
    import psutil
    server = server_factory(models=("identity", "mlp"))
    server.client(arena_bytes=1 << 20).infer("identity", [np.ones((1, 1024), np.float32)])
    root = psutil.Process(server.pid)
    procs = [root] + root.children(recursive=True)
    assert len(procs) >= 3  # coordinator, batcher, workers
    for proc in procs:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "cygrpc" not in maps, f"{proc.cmdline()} loaded grpc"
