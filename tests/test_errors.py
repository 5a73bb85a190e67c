"""Bad input: each gets a clear error naming the model, the tensor and the problem
or limit, and the server keeps serving everyone afterwards."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_serving

import shmserve
from shmserve import errors

pytestmark = pytest.mark.timeout(60)

A16 = np.ones((1, 16), np.int32)


@pytest.fixture(autouse=True)
def still_serving(client):
    yield
    assert_serving(client)


def test_unknown_model(client):
    with pytest.raises(errors.ModelNotFoundError) as e:
        client.infer("no_such_model", {"INPUT0": A16})
    assert "no_such_model" in e.value.msg and "identity" in e.value.msg  # lists what is served


def test_unknown_version(client):
    with pytest.raises(errors.ModelNotFoundError) as e:
        client.infer("versioned", {"INPUT0": np.ones((1, 4), np.int32)}, version=7)
    assert re.search(r"'versioned'.*version 7.*\[1, 2\]", e.value.msg), e.value.msg
    with pytest.raises(errors.ModelNotFoundError):
        client.model_metadata("versioned", version=7)


def test_unknown_input_name(client):
    with pytest.raises(errors.InvalidArgumentError) as e:
        client.infer("identity", {"BOGUS": np.ones((1, 4), np.float32)})
    assert "'identity'" in e.value.msg and "'BOGUS'" in e.value.msg and "INPUT0" in e.value.msg


def test_missing_input(client):
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"model 'simple': missing input 'INPUT1'"):
        client.infer("simple", {"INPUT0": A16})


def test_extra_input(client):
    with pytest.raises(errors.InvalidArgumentError, match=r"'simple' has no input 'INPUT2'"):
        client.infer("simple", {"INPUT0": A16, "INPUT1": A16, "INPUT2": A16})


def test_extra_positional_input(client):
    with pytest.raises(errors.InvalidArgumentError, match="'simple'"):
        client.infer("simple", [A16, A16, A16])


def test_unknown_output(client):
    with pytest.raises(errors.InvalidArgumentError, match=r"'simple' has no output 'OUT9'"):
        client.infer("simple", [A16, A16], outputs=["OUT9"])


def test_wrong_dtype(client):
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' has data type FP32, expected INT32"):
        client.infer("simple", {"INPUT0": A16.astype(np.float32), "INPUT1": A16})
    with pytest.raises(errors.InvalidArgumentError, match=r"'identity'.*'INPUT0'.*complex64"):
        client.infer("identity", {"INPUT0": np.ones((1, 4), np.complex64)})


def test_wrong_shape(client):
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' dimension 1 is 15, expected 16"):
        client.infer("simple", [np.ones((1, 15), np.int32), A16])
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' has 1 dimensions, expected 2"):
        client.infer("simple", [np.ones(16, np.int32), A16])
    with pytest.raises(errors.InvalidArgumentError, match=r"'mlp': input 'INPUT0' dimension 1 is 255"):
        client.infer("mlp", [np.ones((1, 255), np.float32)])
    with pytest.raises(errors.InvalidArgumentError, match=r"'simple'.*'INPUT1' batch size 3 differs"):
        client.infer("simple", [np.ones((2, 16), np.int32), np.ones((3, 16), np.int32)])


def test_batch_larger_than_max_batch_size(client):
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"'simple': input 'INPUT0' batch size 9 outside 1\.\.8"):
        client.infer("simple", [np.ones((9, 16), np.int32)] * 2)
    with pytest.raises(errors.InvalidArgumentError, match=r"batch size 0 outside 1\.\.64"):
        client.infer("identity", [np.ones((0, 4), np.float32)])


def test_tensor_larger_than_arena(main_server, make_client):
    c = make_client(arena_bytes=64 << 10)
    big = np.ones((1, 64 << 10), np.float32)  # 256 KiB into a 64 KiB arena
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.infer("identity", [big])
    msg = e.value.msg
    assert "'identity'" in msg and "arena" in msg and str(64 << 10) in msg, msg
    with pytest.raises(errors.InvalidArgumentError, match="arena"):
        c.empty((1, 64 << 10), np.float32)
    assert_serving(c)  # the same small client still works for what fits


def test_tensor_larger_than_arena_names_the_tensor(main_server, make_client):
    c = make_client(arena_bytes=64 << 10)
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.infer("identity", [np.ones((1, 64 << 10), np.float32)])
    assert "INPUT0" in e.value.msg, e.value.msg


@pytest.mark.parametrize("arena_bytes", [1 << 41, -1])
def test_arena_larger_than_server_allows(main_server, arena_bytes):
    """The refusal names the range and that 0 (which it accepts) means the default."""
    with pytest.raises(errors.InvalidArgumentError) as e:
        shmserve.Client(main_server.name, socket_path_=str(main_server.socket_path),
                        arena_bytes=arena_bytes)
    assert e.value.msg.startswith(f"arena of {arena_bytes} bytes refused: this server allows "
                                  f"1 to {1 << 40} bytes (--max-arena-bytes), or 0 for its "
                                  "default of "), e.value.msg


def _queued_sleeper(policy: str):
    import helpers

    def setup(repo):
        helpers.write_model(repo, "q_sleeper", helpers.python_config(
            "q_sleeper", "FP32", (-1,), max_batch_size=1,
            dynamic_batching="{ default_queue_policy { %s } }" % policy), helpers.SLEEPER_CODE)
    return setup


def test_full_model_queue_answers_busy(server_factory):
    """dynamic_batching.default_queue_policy.max_queue_size (Triton's): requests past
    it are answered BUSY at once, naming the model and the limit; the rest are served."""
    server = server_factory(setup=_queued_sleeper("max_queue_size: 2"))
    c = server.client(arena_bytes=1 << 20)
    x = np.array([[0.3]], np.float32)
    futures = [c.submit("q_sleeper", [x]) for _ in range(6)]
    busy, ok = [], 0
    for f in futures:
        try:
            f.result(timeout=30)
            ok += 1
        except errors.BusyError as e:
            busy.append(e.msg)
    assert ok >= 2 and len(busy) >= 3, (ok, busy)  # one running, two queued, the rest refused
    assert all("'q_sleeper'" in m and "max_queue_size 2" in m for m in busy), busy
    (row,) = c.statistics("q_sleeper")
    assert row["inference_stats"]["fail"]["count"] == len(busy)
    assert row["shmserve"]["failures"]["REJECTED"] == len(busy)  # queue full


def test_queue_timeout_rejects_requests_that_waited_too_long(server_factory):
    """default_timeout_microseconds with timeout_action REJECT: a request still queued
    after the timeout is answered UNAVAILABLE; the one running is not affected."""
    server = server_factory(setup=_queued_sleeper(
        "default_timeout_microseconds: 100000 timeout_action: REJECT"))
    c = server.client(arena_bytes=1 << 20)
    futures = [c.submit("q_sleeper", [np.array([[0.5]], np.float32)]) for _ in range(3)]
    outcomes = []
    for f in futures:
        try:
            f.result(timeout=30)
            outcomes.append("ok")
        except errors.UnavailableError as e:
            assert "timed out in the queue after 100000 us" in e.msg, e.msg
            outcomes.append("timed out")
    assert outcomes.count("ok") >= 1 and outcomes.count("timed out") >= 1, outcomes


@pytest.mark.timeout(300)
def test_a_thousand_caller_deaths_leave_every_lease_free(server_factory):
    """1000 clients SIGKILLed with a request in flight: every lease ends, every arena
    is released by the coordinator and unmapped by the batcher and the workers, and no
    server process dies."""
    import subprocess
    import sys

    import helpers

    server = server_factory(setup=lambda repo: helpers.write_model(
        repo, "sleeper", helpers.python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
        helpers.SLEEPER_CODE), args=["--max-clients", "1024", "--slots-per-client", "4"])
    before = server.members()
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import helpers; "
            f"print(helpers.doomed_clients({str(server.socket_path)!r}, {server.name!r}, 1000))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.stdout, r.stderr[-2000:])

    def arena_mappings() -> dict[int, int]:
        out = {}
        for pid in server.members():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            out[pid] = maps.count("memfd:shmserve-arena-")
        return out

    helpers.wait_until(lambda: not server.arenas(), 20, "the coordinator to close every arena",
                       state=server.arenas)
    helpers.wait_until(lambda: not any(arena_mappings().values()), 20,
                       "the server processes to unmap every arena", state=arena_mappings)
    assert server.members() == before, "a server process died:\n" + server.log(2000)
    assert_serving(server.client(arena_bytes=1 << 20))


def test_arena_larger_than_available_memory(main_server):
    """An arena (a memfd, outside /dev/shm) larger than the memory available is
    refused with the numbers, as a ShmSpaceError: the server reserves every arena up
    front, so a mapping never faults later."""
    from shmserve.server.segments import mem_available_bytes

    want = mem_available_bytes() + (1 << 30)
    if want > 1 << 40:
        pytest.skip("more memory available than the main server's --max-arena-bytes")
    with pytest.raises(errors.ShmSpaceError) as e:
        shmserve.Client(main_server.name, socket_path_=str(main_server.socket_path),
                        arena_bytes=want)
    msg = e.value.msg
    assert "not enough space in memory for the arena" in msg and "MiB free" in msg, msg


AT_FILE_LIMIT = """
import os, resource, sys
import shmserve
name, path = sys.argv[1], sys.argv[2]
shmserve.Client(name, socket_path_=path, arena_bytes=1 << 16).close()  # everything imported
top = max(int(n) for n in os.listdir("/proc/self/fd"))
while True:  # fill every free descriptor number up to the highest in use
    fd = os.open("/dev/null", os.O_RDONLY)
    if fd > top:
        os.close(fd)
        break
resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:  # room for the socket (descriptor fd), none for the arena and the control segment
    shmserve.Client(name, socket_path_=path, arena_bytes=1 << 16)
except shmserve.ShmServeError as e:
    print(type(e).__name__, e)
"""


def test_hello_descriptors_cut_off_at_the_open_file_limit(main_server):
    """A client at its open-file limit cannot receive the hello reply's descriptors:
    the kernel drops them and flags MSG_CTRUNC; the client says so (and why), instead
    of counting descriptors or mapping the wrong ones."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", AT_FILE_LIMIT, main_server.name,
                        str(main_server.socket_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ShmServeError ") and "cut off (MSG_CTRUNC" in r.stdout and \
        "open-file limit" in r.stdout, r.stdout


def test_model_that_raises(client):
    x = np.array([[1.0, -2.0]], np.float32)
    with pytest.raises(errors.InternalError) as e:
        client.infer("raiser", [x])
    msg = e.value.msg
    assert "'raiser'" in msg and "ValueError" in msg and "boom: negative input" in msg, msg
    # the worker survived its model's exception
    y = np.abs(x)
    np.testing.assert_array_equal(client.infer("raiser", [y])["OUTPUT0"], y)


def test_model_output_not_matching_config(client):
    with pytest.raises(errors.InternalError, match=r"'raiser' output 'OUTPUT0' is float64"):
        client.infer("raiser", [np.array([[7777.0]], np.float32)])
    with pytest.raises(errors.InternalError, match=r"'raiser' did not produce output 'OUTPUT0'"):
        client.infer("raiser", [np.array([[8888.0]], np.float32)])


def test_unavailable_model_answers_at_once(client):
    """A model whose initialize() raised is listed UNAVAILABLE; a request to it is
    refused with that reason instead of waiting forever."""
    with pytest.raises(errors.UnavailableError) as e:
        client.infer("broken", [np.ones((1, 3), np.float32)], timeout=20)
    assert "'broken'" in e.value.msg, e.value.msg


def test_timeout(main_server, make_client):
    c = make_client(arena_bytes=1 << 20)
    with pytest.raises(errors.ServerTimeoutError, match="'sleeper'"):  # the model takes 1.5 s
        c.infer("sleeper", [np.array([[1.5]], np.float32)], timeout=0.2)
    assert_serving(c)  # the same client goes on, its abandoned slot comes back later
    np.testing.assert_array_equal(
        c.infer("sleeper", [np.array([[0.0, 4.0]], np.float32)], timeout=30)["OUTPUT0"],
        [[0.0, 4.0]])


def test_client_process_killed_mid_request(main_server, tmp_path):
    """A client that dies with a request in flight loses nothing for the others and
    its arena is reclaimed (the lease is its socket)."""
    import multiprocessing

    import helpers

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=helpers.doomed_client,
                       args=(str(main_server.socket_path), main_server.name, ready))
    before = set(main_server.arenas())
    proc.start()
    try:
        assert ready.wait(30), "the doomed client never sent its request"
        arenas = set(main_server.arenas()) - before
        assert len(arenas) == 1, arenas
        os.kill(proc.pid, 9)
        proc.join(10)
        helpers.wait_until(lambda: not (set(main_server.arenas()) & arenas), 10,
                           "the dead client's arena to be released")
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_request_refused_before_sending_keeps_its_slot(main_server):
    """A request the client itself cannot encode (more dimensions than the protocol
    carries) is an InvalidArgumentError, and its slot comes back: as many such errors
    as the lease has slots leave the client serving."""
    with main_server.client(arena_bytes=1 << 20) as c:
        too_deep = np.ones((1,) * 9, np.float32)
        for _ in range(40):  # more than the 32 slots of a lease
            with pytest.raises(errors.InvalidArgumentError, match="identity"):
                c.infer("identity", [too_deep])
        out = c.infer("identity", [np.ones((1, 8), np.float32)], copy=True)
        assert out["OUTPUT0"].shape == (1, 8)
