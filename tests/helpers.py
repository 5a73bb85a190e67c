"""Shared helpers of the test suite: writing model repositories, running real
server processes, raw protocol access for hostile-client tests.

Everything here drives real processes; nothing mocks the engine."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shmserve
from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_REPO = REPO_ROOT / "model_repository"

try:
    import ml_dtypes

    HAVE_BF16 = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_BF16 = False

DTYPES = ["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
          "FP16", "FP32", "FP64", "BYTES", "BF16"]


# ---------------------------------------------------------------- model repositories

def server_segment_with_one_model(n_clients: int, slots: int, n_workers: int,
                                  max_batch: int = 8):
    """An in-process server segment (no server) whose model 0, "m", batched and READY,
    maps IN [4] to OUT [4], FP32, with n_workers instances: (layout, mmap, Mapping)."""
    import mmap
    import types

    from shmserve import _core
    from shmserve.server.coordinator import Coordinator
    from shmserve.server.repository import ModelSpec, TensorSpec
    from shmserve.server.segments import ServerLayout

    fp32 = int(P.DataType.FP32)
    layout = ServerLayout(n_clients, slots, 1, n_workers)
    mm = mmap.mmap(-1, layout.size)
    srv = _core.Mapping(mm)
    srv.init_server(n_clients, slots, 1, n_workers)
    spec = ModelSpec(name="m", version=1, backend="python", path="", max_batch_size=max_batch,
                     inputs=(TensorSpec("IN", fp32, (4,)),), outputs=(TensorSpec("OUT", fp32, (4,)),),
                     instance_count=n_workers, dynamic_batching=True, preferred_batch_sizes=(),
                     max_queue_delay_us=0, parameters={}, config_text="")
    owner = types.SimpleNamespace(layout=layout, server=types.SimpleNamespace(ops=srv))
    Coordinator.write_model_entry(owner, 0, spec)
    srv.store32(layout.model(0) + L["model.ready"], 1)
    return layout, mm, srv


def write_model(repo: Path, name: str, config: str, code: str | None = None,
                versions=(1,)) -> Path:
    """A python-backend model: <repo>/<name>/config.pbtxt and <v>/model.py."""
    model_dir = repo / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config)
    for v in versions:
        (model_dir / str(v)).mkdir(exist_ok=True)
        if code is not None:
            (model_dir / str(v) / "model.py").write_text(code)
    return model_dir


def tensor_config(name: str, dtype: str, dims) -> str:
    triton_type = "TYPE_STRING" if dtype == "BYTES" else f"TYPE_{dtype}"
    return f'{{ name: "{name}" data_type: {triton_type} dims: [ {", ".join(map(str, dims))} ] }}'


def python_config(name: str, dtype: str = "FP32", dims=(-1,), max_batch_size: int = 8,
                  dynamic_batching: str | None = "{ }", extra: str = "",
                  out_dtype: str | None = None, out_dims=None) -> str:
    lines = [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
             f"input [ {tensor_config('INPUT0', dtype, dims)} ]",
             f"output [ {tensor_config('OUTPUT0', out_dtype or dtype, out_dims or dims)} ]"]
    if dynamic_batching is not None:
        lines.append(f"dynamic_batching {dynamic_batching}")
    lines.append(extra)
    return "\n".join(lines) + "\n"


IDENTITY_CODE = '''
class TritonPythonModel:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
'''

# Sleeps INPUT0[0, 0] seconds, *then* reads its input: a caller that changes an
# input living in its arena after submit() sees the change in the output (zero copy).
SLEEPER_CODE = '''
import time

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        time.sleep(float(abs(x.reshape(-1)[0])))
        return {"OUTPUT0": x.copy()}
'''

SLOW_CODE = '''
import time

class TritonPythonModel:
    def execute(self, inputs):
        time.sleep(0.002)
        return {"OUTPUT0": inputs["INPUT0"].copy()}
'''

RAISER_CODE = '''
import numpy as np

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        if (x < 0).any():
            raise ValueError("boom: negative input")
        if (x == 7777).any():
            return {"OUTPUT0": x.astype(np.float64)}   # not the configured FP32
        if (x == 8888).any():
            return {"WRONG": x}
        return {"OUTPUT0": x}
'''

VERSIONED_CODE = '''
import numpy as np

class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"] + np.int32(self.version)}
'''

GROW_CODE = '''
import numpy as np

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        return {"OUTPUT0": np.concatenate([x, x, x], axis=1)}
'''

BROKEN_INIT_CODE = '''
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot load weights")

    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"]}
'''

CRASHER_CODE = '''
import os

class TritonPythonModel:
    def execute(self, inputs):
        x = inputs["INPUT0"]
        if (x < 0).any():
            os._exit(7)           # the worker process dies mid-batch
        return {"OUTPUT0": x.copy()}
'''


TWIN_CODE = '''
import os
import time
import numpy as np

class TritonPythonModel:
    def execute(self, inputs):
        time.sleep(0.5)
        return {"OUTPUT0": np.full((len(inputs["INPUT0"]), 1), os.getpid(), np.int64)}
'''


# Triton's python API: each row of OUTPUT0 is its request's parameters as the model
# reads them (request.parameters(), a JSON string).
PARAMS_CODE = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            n = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy().shape[0]
            text = r.parameters().encode()
            out = np.array([[text]] * n, dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
'''


def gpu_torch():
    """torch, where it is installed with CUDA and sees a GPU; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def write_affine(repo: Path, torch, config: str, name: str = "affine") -> None:
    """A TorchScript model computing x * 2 + 1 (torch given: the caller's import), with
    `config` as its config.pbtxt."""

    class Affine(torch.nn.Module):
        def forward(self, x):
            return x * 2.0 + 1.0

    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(Affine()).save(str(repo / name / "1" / "model.pt"))
    (repo / name / "config.pbtxt").write_text(config)


def copy_bundled(repo: Path, mlp_onnx: Path | None, names=("identity", "simple", "mlp")) -> None:
    for name in names:
        src = BUNDLED_REPO / name
        dst = repo / name
        (dst / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(src / "config.pbtxt", dst / "config.pbtxt")
        if name == "mlp":
            shutil.copy(mlp_onnx, dst / "1" / "model.onnx")
        else:
            shutil.copy(src / "1" / "model.py", dst / "1" / "model.py")


def write_test_models(repo: Path) -> None:
    """The extra models the end-to-end tests use (one python worker each)."""
    for dt in DTYPES:
        if dt == "BF16" and not HAVE_BF16:
            continue
        write_model(repo, f"id_{dt}", python_config(
            f"id_{dt}", dt, (-1,), max_batch_size=16,
            dynamic_batching="{ max_queue_delay_microseconds: 2000 }"), IDENTITY_CODE)
    write_model(repo, "unbatched", python_config("unbatched", "INT16", (2, -1), max_batch_size=0,
                                                 dynamic_batching=None), IDENTITY_CODE)
    write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
                SLEEPER_CODE)
    write_model(repo, "slow", python_config("slow", "FP32", (-1,), max_batch_size=64), SLOW_CODE)
    write_model(repo, "raiser", python_config("raiser", "FP32", (-1,)), RAISER_CODE)
    write_model(repo, "versioned", python_config(
        "versioned", "INT32", (4,), extra="version_policy { all { } }"), VERSIONED_CODE,
        versions=(1, 2))
    write_model(repo, "grow", python_config("grow", "FP32", (-1,)), GROW_CODE)
    write_model(repo, "broken", python_config("broken", "FP32", (-1,)), BROKEN_INIT_CODE)
    write_model(repo, "preferred", python_config(
        "preferred", "FP32", (-1,), dynamic_batching="{ preferred_batch_size: [ 4 ] "
        "max_queue_delay_microseconds: 3000000 }"), IDENTITY_CODE)
    write_model(repo, "params", python_config("params", "FP32", (-1,), out_dtype="BYTES",
                                              out_dims=(1,)), PARAMS_CODE)
    write_model(repo, "twin", python_config(
        "twin", "FP32", (-1,), dynamic_batching=None, out_dtype="INT64", out_dims=(1,),
        extra="instance_group [ { count: 2 kind: KIND_CPU } ]"), TWIN_CODE)


# ---------------------------------------------------------------- processes and /dev/shm

# The server harness is shared with bench/ and scripts/soak.py; re-exported for the tests.
from shmserve_bench.harness import ARENA_LABEL, ServerProcess, poll_until  # noqa: E402,F401
from shmserve_bench.harness import unique_name  # noqa: E402
from shmserve_bench.proctree import children_of, cmdline, group_members, open_memfds, shm_files  # noqa: E402,F401


def memfd_path(pid: int, label: str) -> str:
    """/proc/<pid>/fd/<n> of the memfd labelled `label` that process pid holds: a
    coordinator's "shmserve-control" or "shmserve-server"."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{label} "):
                return f"/proc/{pid}/fd/{fd}"
        except OSError:  # closed meanwhile
            continue
    raise AssertionError(f"process {pid} holds no memfd {label!r}")


def maps_memfd(pid: int, label: str) -> bool:
    """Whether process pid has the memfd labelled `label` mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return any(f"/memfd:{label} " in line for line in f)
from shmserve_bench.hostile import RawLease  # noqa: E402,F401


def module_server(tmp_path_factory, write_repository, prefix: str, args=()):
    """A server of its own repository (write_repository(repo) fills it) shared by a
    module's tests: yields it, then stops it and fails on anything it left behind.
    Use as the body of a module-scoped fixture: `yield from module_server(...)`."""
    repo = tmp_path_factory.mktemp(prefix)
    write_repository(repo)
    server = ServerProcess(repo, name=unique_name(prefix), args=args,
                           log_path=tmp_path_factory.mktemp("logs") / "server.log")
    try:
        server.start()
        yield server
    finally:
        problems = server.teardown()
        assert not problems, "\n".join(problems) + "\n--- server log ---\n" + server.log()


def front_server(tmp_path_factory, write_repository, prefix: str, port: int, args, connect):
    """module_server with a network front on `port` (args: its serve flags): yields
    (server, connect(server, port) (a client of the front, closed at the end), port);
    the tests' own clients find the server through SHMSERVE_RUNTIME_DIR meanwhile."""
    servers = module_server(tmp_path_factory, write_repository, prefix, args)
    server = next(servers)
    mp = pytest.MonkeyPatch()
    mp.setenv("SHMSERVE_RUNTIME_DIR", str(server.runtime_dir))
    client = None
    try:
        client = connect(server, port)
        yield server, client, port
    finally:
        if client is not None:
            client.close()
        mp.undo()
        servers.close()  # stops the server, failing on what it left behind


def cpu_bound_process() -> subprocess.Popen:
    """A process that spins on the CPU, returned once its interpreter has started: while
    it still starts up it blocks on page faults and hands a yielded CPU back early, which
    cuts a spin without losing a slice (seen in CI). Stop it with kill() + communicate()."""
    busy = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('spinning', flush=True)\nwhile True: pass"],
        stdout=subprocess.PIPE, text=True)
    assert busy.stdout.readline() == "spinning\n"
    return busy


def wait_until(predicate, timeout: float, what: str, *, state=None, interval: float = 0.02):
    """Waits until predicate() is true, at most timeout s; fails the test naming `what`
    it waited for (and state(), if given, as last seen). Returns predicate()'s value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; last seen: {state()!r}" if state is not None else ""
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}{seen}")
        time.sleep(interval)


def lease_slot_states(server, client_id: int) -> list[P.SlotState]:
    """The states of a lease's slots that are not FREE, sorted: read from its arena
    through the coordinator's descriptor, as the batcher opens it (the protocol's
    layout, no client internals)."""
    def u(buf: bytes, field: str) -> int:
        return int.from_bytes(buf[L[field]:L[field] + L[field + ".bytes"]], "little")

    fd_dir = f"/proc/{server.pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:" + ARENA_LABEL):
                continue
            arena = os.open(f"{fd_dir}/{fd}", os.O_RDONLY)
        except OSError:  # closed meanwhile
            continue
        try:
            head = os.pread(arena, L["arena.size"], 0)
            if u(head, "arena.client_id") != client_id:
                continue
            offsets = (u(head, "arena.slots_offset") + i * L["slot.size"] + L["slot.state"]
                       for i in range(u(head, "arena.n_slots")))
            states = (int.from_bytes(os.pread(arena, 4, off), "little") for off in offsets)
            return sorted(P.SlotState(st) for st in states if st != P.SlotState.FREE)
        finally:
            os.close(arena)
    raise AssertionError(f"the coordinator holds no arena of client {client_id}")


def wait_in_flight(server, client, *states: P.SlotState, timeout: float = 10.0) -> None:
    """Waits until the client's busy slots are exactly in these states: e.g. one
    request RUNNING in a worker and one QUEUED in the batcher behind it."""
    want = sorted(states)
    wait_until(lambda: lease_slot_states(server, client.client_id) == want, timeout,
               f"the client's requests in flight to be {[s.name for s in want]}",
               state=lambda: [s.name for s in lease_slot_states(server, client.client_id)])


# ---------------------------------------------------------------- raw protocol client

def assert_serving(client, model: str = "identity") -> None:
    """The server still answers a plain request correctly."""
    x = np.arange(12, dtype=np.float32).reshape(1, 12)
    out = client.infer(model, {"INPUT0": x}, copy=True, timeout=30)
    np.testing.assert_array_equal(out["OUTPUT0"], x)


def doomed_client(socket_path: str, name: str, ready) -> None:
    """Child process: sends a request to the sleeper and waits to be killed."""
    c = shmserve.Client(name, socket_path_=socket_path, arena_bytes=1 << 20)
    c.submit("sleeper", {"INPUT0": np.array([[3.0]], np.float32)})
    ready.set()
    time.sleep(60)


def busy_client(socket_path: str, name: str, index: int, n: int) -> str:
    """Child process: its own Client, its own data, checks its own answers.
    Returns "" on success, else what went wrong."""
    rng = np.random.default_rng(1000 + index)
    try:
        with shmserve.Client(name, socket_path_=socket_path, arena_bytes=4 << 20) as c:
            for i in range(n):
                a = rng.integers(-1000, 1000, (1 + i % 3, 16), dtype=np.int32)
                b = np.full_like(a, index)
                out = c.infer("simple", {"INPUT0": a, "INPUT1": b})
                if not (np.array_equal(out["OUTPUT0"], a + b)
                        and np.array_equal(out["OUTPUT1"], a - b)):
                    return f"client {index}: wrong answer from simple at request {i}"
                x = rng.standard_normal((1 + i % 2, 33)) + index
                if not np.array_equal(c.infer("id_FP64", [x])["OUTPUT0"], x):
                    return f"client {index}: wrong answer from id_FP64 at request {i}"
                y = np.full((1, 8), index * 1000 + i, np.float32)
                if not np.array_equal(c.infer("slow", [y])["OUTPUT0"], y):
                    return f"client {index}: wrong answer from slow at request {i}"
    except Exception as e:  # reported, not raised: the parent asserts on it
        return f"client {index}: {type(e).__name__}: {e}"
    return ""


def start_sleeper_request(raw: RawLease, seconds: float) -> None:
    """Sends the sleeper a request to sleep `seconds` from slot 0 of a raw lease and
    waits until it is RUNNING (its output goes into the lease's arena at the end)."""
    d = raw.data_offset
    raw.buf[d:d + 4] = np.array([seconds], np.float32).tobytes()
    gen = raw.write_raw_request(0, raw.model_ids["sleeper"], 1, 1,
                                [(0, P.DTYPE_CODES["FP32"], 2, d, 4, (1, 1))],
                                [(0, 0, 0, d + 4096, 4096, ())])
    raw.push(0, gen)
    wait_until(lambda: raw.state(0) == P.SlotState.RUNNING, 10,
               "the raw request to be RUNNING in the sleeper")


def truncating_client(socket_path: str, ready) -> None:
    """Child process: a hostile caller that shrinks its own arena to 0 bytes while
    the server works on its request (it must not touch the mapping afterwards)."""
    raw = RawLease(Path(socket_path))
    start_sleeper_request(raw, 0.5)
    try:
        os.ftruncate(raw.arena_fd, 0)
        ready.set()
    except PermissionError:  # sealed (F_SEAL_SHRINK): what the test hopes for
        ready.set()
        return
    time.sleep(60)


def doomed_clients(socket_path: str, name: str, count: int, at_once: int = 8) -> int:
    """Run in a process of its own: `count` children, `at_once` alive at a time, each
    opens a lease, submits a request to the sleeper and is SIGKILLed (by itself) with
    the request in flight. Forked, so each death costs milliseconds. Returns how many
    children did not die that way (a client that failed before its request)."""
    def child() -> None:
        c = shmserve.Client(name, socket_path_=socket_path, arena_bytes=64 << 10)
        c.submit("sleeper", {"INPUT0": np.array([[0.01]], np.float32)})
        os.kill(os.getpid(), signal.SIGKILL)

    alive: set[int] = set()
    failed = 0

    def reap() -> None:
        nonlocal failed
        pid, status = os.wait()
        alive.discard(pid)
        failed += not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)

    for _ in range(count):
        while len(alive) >= at_once:
            reap()
        pid = os.fork()
        if pid == 0:
            try:
                child()
            finally:
                os._exit(3)  # only reached if the client failed: counted by the parent
        alive.add(pid)
    while alive:
        reap()
    return failed
