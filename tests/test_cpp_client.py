"""The C++ client (clients/cpp) against live servers: its own test program (built
with CMake and g++, once normally and once under AddressSanitizer + UBSan), its
example, identical bytes with the Python client, and a server shutdown.

Needs cmake, g++ and the msgpack-cxx headers (README: "C++ client"); .ci/run
installs them. Without them these tests are skipped with the reason."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import (DTYPES, HAVE_BF16, REPO_ROOT, SLEEPER_CODE, gpu_torch, python_config,
                     write_affine, write_model)

from shmserve import protocol as P

# A watchdog, not a time asserted: the first test also waits for the session's build
# (four targets, one under ASan), which took over 300 s on two shared, loaded cores.
pytestmark = pytest.mark.timeout(900)

CPP = REPO_ROOT / "clients" / "cpp"
VECTORS = REPO_ROOT / "tests" / "vectors" / "protocol_vectors.json"
MSGPACK_DIRS = ("/usr/include", "/usr/local/include")


def _missing() -> str | None:
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (README: C++ client)"
    if not any(Path(d, "msgpack.hpp").exists() for d in MSGPACK_DIRS):
        return "msgpack-cxx headers are not installed (apt-get install libmsgpack-cxx-dev)"
    return None


@pytest.fixture(scope="session")
def cpp_build(tmp_path_factory) -> Path:
    """One CMake configure, every target in one parallel build: the tests (plain and
    under ASan + UBSan, -O1) and the examples (-O0: built and smoke-run here only)."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    build_dir = tmp_path_factory.mktemp("cpp-build")
    configure = ["cmake", "-S", str(CPP), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=",
                 "-DCMAKE_CXX_FLAGS=-O0 -Werror -Wall -Wextra", "-DSHMSERVE_CLIENT_SANITIZERS=ON"]
    build = ["cmake", "--build", str(build_dir), "-j", str(max(2, os.cpu_count() or 2)),
             "--target", "shmserve_cpp_tests", "shmserve_cpp_tests_sanitized", "shmserve_infer",
             "shmserve_latency"]
    for cmd in (configure, build):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return build_dir


def _run(cmd: list, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{cmd[0]} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


def test_cpp_suite(cpp_build, main_server):
    r = _run([cpp_build / "shmserve_cpp_tests", "suite", "--socket", main_server.socket_path,
              "--vectors", VECTORS])
    assert "suite: 0 failures" in r.stdout


def test_cpp_suite_under_address_and_undefined_behavior_sanitizers(cpp_build, main_server):
    r = _run([cpp_build / "shmserve_cpp_tests_sanitized", "suite", "--socket",
              main_server.socket_path, "--vectors", VECTORS],
             env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"})
    assert "suite: 0 failures" in r.stdout
    assert "runtime error" not in r.stderr and "AddressSanitizer" not in r.stderr, r.stderr


def test_cpp_example_program(cpp_build, main_server):
    r = _run([cpp_build / "shmserve_infer", "simple", "--name", main_server.name],
             env={"SHMSERVE_RUNTIME_DIR": str(main_server.runtime_dir)})
    assert "OUTPUT0 INT32 [1, 16]: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16" in r.stdout
    assert "OUTPUT1 INT32 [1, 16]: -1 0 1 2" in r.stdout
    for spin in ("100", "0"):  # 0: the caller sleeps at once (run_all's client-work figure)
        r = _run([cpp_build / "shmserve_latency", "--name", main_server.name, "--requests", "200",
                  "--warmup", "20", "--spin-us", spin],
                 env={"SHMSERVE_RUNTIME_DIR": str(main_server.runtime_dir)})
        assert f"spin {spin} us, 200 requests: p50" in r.stdout, r.stdout
    # several in flight from one thread (run_all's client figure at mlp 32): every
    # identity answer is still checked against its input
    r = _run([cpp_build / "shmserve_latency", "--name", main_server.name, "--requests", "300",
              "--warmup", "20", "--model", "identity", "--concurrency", "8"],
             env={"SHMSERVE_RUNTIME_DIR": str(main_server.runtime_dir)})
    assert "identity 4096 bytes, concurrency 8, copied input" in r.stdout, r.stdout
    assert "300 requests: p50" in r.stdout, r.stdout


def _inputs_for(model: str, rng) -> dict:
    if model == "simple":
        return {"INPUT0": rng.integers(-2**31, 2**31, (3, 16), dtype=np.int32),
                "INPUT1": rng.integers(-2**31, 2**31, (3, 16), dtype=np.int32)}
    if model == "identity":
        return {"INPUT0": rng.standard_normal((1, 1024)).astype(np.float32)}
    dtype = model[3:]
    if dtype == "BYTES":
        return {"INPUT0": np.array([bytes(rng.integers(0, 256, i % 5, dtype=np.uint8))
                                    for i in range(10)], dtype=object).reshape(2, 5)}
    if dtype == "BOOL":
        return {"INPUT0": rng.integers(0, 2, (4, 9)).astype(np.bool_)}
    raw = rng.integers(0, 256, 4 * 9 * P.numpy_dtype(P.DTYPE_CODES[dtype]).itemsize, dtype=np.uint8)
    return {"INPUT0": raw.view(P.numpy_dtype(P.DTYPE_CODES[dtype])).reshape(4, 9)}


def _raw(arr: np.ndarray) -> bytes:
    return P.encode_bytes(arr) if arr.dtype == object else arr.tobytes()


def test_cpp_client_at_the_open_file_limit_says_the_descriptors_were_cut_off(cpp_build,
                                                                             main_server):
    """Room for the control socket (descriptor 3) and none for the hello reply's two:
    the kernel drops them (MSG_CTRUNC) and the client says so, naming the limit."""
    import resource

    def at_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    r = subprocess.run([str(cpp_build / "shmserve_infer"), "simple", "--name", main_server.name],
                       capture_output=True, text=True, timeout=60, preexec_fn=at_limit,
                       env={**os.environ, "SHMSERVE_RUNTIME_DIR": str(main_server.runtime_dir)})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "cut off (MSG_CTRUNC" in r.stderr and "open-file limit" in r.stderr, r.stderr


def test_cpp_and_python_clients_return_identical_bytes(cpp_build, main_server, client, tmp_path):
    rng = np.random.default_rng(7)
    models = ["simple", "identity"] + [f"id_{d}" for d in DTYPES if d != "BF16" or HAVE_BF16]
    requests, lines = {}, []
    for i, model in enumerate(models):
        inputs = _inputs_for(model, rng)
        requests[str(i)] = (model, inputs)
        fields = [str(i), model, str(len(inputs))]
        for name, arr in inputs.items():
            code = P.dtype_code(arr.dtype)
            fname = f"{i}.{name}.in"
            (tmp_path / fname).write_bytes(_raw(arr))
            fields += [name, P.DTYPE_NAMES[code], str(arr.ndim), *map(str, arr.shape), fname]
        lines.append(" ".join(fields))
    (tmp_path / "manifest.txt").write_text("\n".join(lines) + "\n")
    _run([cpp_build / "shmserve_cpp_tests", "roundtrip", "--socket", main_server.socket_path,
          "--dir", tmp_path])
    for rid, (model, inputs) in requests.items():
        out = client.infer(model, inputs, copy=True)
        assert len(out) >= 1
        for name, arr in out.items():
            cpp = (tmp_path / f"{rid}.{name}.bin").read_bytes()
            meta = (tmp_path / f"{rid}.{name}.meta").read_text().split()
            assert cpp == _raw(arr), f"{model} {name}: C++ and Python bytes differ"
            assert meta[0] == P.DTYPE_NAMES[P.dtype_code(arr.dtype)], (model, name, meta)
            assert [int(d) for d in meta[1:]] == list(arr.shape), (model, name, meta)


def test_cpp_client_sees_server_shutdown_as_an_error(cpp_build, server_factory):
    # No drain: the requests still in flight when the server stops get the error.
    server = server_factory(models=("identity",), setup=lambda repo: write_model(
        repo, "sleeper", python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
        SLEEPER_CODE), args=["--exit-timeout-secs", "0"])
    proc = subprocess.Popen([str(cpp_build / "shmserve_cpp_tests"), "shutdown", "--socket",
                             str(server.socket_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        server.stop()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "shutdown: 0 failures" in out


def test_installed_client_is_found_by_find_package(cpp_build, tmp_path):
    prefix, build = tmp_path / "prefix", tmp_path / "consumer"
    _run(["cmake", "--install", cpp_build, "--prefix", prefix])
    assert (prefix / "include" / "shmserve.h").exists()
    _run(["cmake", "-S", CPP / "tests" / "consumer", "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}",
          "-DCMAKE_CXX_FLAGS=-O0"])
    _run(["cmake", "--build", build])
    assert "FP32 is 4 bytes" in _run([build / "consumer"]).stdout


NOBODY = 65534  # uid and gid "nobody"/"nogroup" on Debian


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_group_member_of_another_uid_is_served_and_others_are_refused(cpp_build, server_factory,
                                                                       tmp_path_factory):
    """serve --group: a process of another uid whose group is that group is a client
    (socket 0660, control segment 0660, arena by descriptor); the same uid in another
    group is refused at the control socket. The C++ example runs as uid nobody (the
    Python interpreter of this checkout may not be reachable by other users)."""
    import tempfile

    server = server_factory(models=("simple",), args=["--group", str(NOBODY)])
    exe_dir = Path(tempfile.mkdtemp(prefix="shms-exe-", dir="/tmp"))
    try:
        exe_dir.chmod(0o755)
        exe = exe_dir / "shmserve_infer"
        shutil.copy2(cpp_build / "shmserve_infer", exe)
        exe.chmod(0o755)
        env = {"SHMSERVE_RUNTIME_DIR": str(server.runtime_dir), "PATH": "/usr/bin:/bin"}
        for path in (server.socket_path, server.runtime_dir):
            assert os.stat(path).st_gid == NOBODY, path
        ok = subprocess.run([str(exe), "simple", "--name", server.name], capture_output=True,
                            text=True, timeout=60, env=env, user=NOBODY, group=NOBODY,
                            extra_groups=[])
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "OUTPUT0 INT32 [1, 16]: 1 2 3 4" in ok.stdout
        refused = subprocess.run([str(exe), "simple", "--name", server.name], capture_output=True,
                                 text=True, timeout=60, env=env, user=NOBODY, group=4242,
                                 extra_groups=[])
        assert refused.returncode != 0, refused.stdout
        assert "Error" in refused.stderr or "error" in refused.stderr, refused.stderr
        assert server.log(10**6).count("client connected: ") == 1  # only the group member's lease
    finally:
        shutil.rmtree(exe_dir, ignore_errors=True)


def test_cpp_model_control(cpp_build, server_factory):
    """load / unload / index through the C++ client; its stale handle after another
    client's reload and after an unload gets the server's words."""
    server = server_factory(models=("identity", "simple"),
                            args=["--model-control-mode", "explicit", "--load-model", "simple"])
    r = _run([cpp_build / "shmserve_cpp_tests", "control", "--socket", server.socket_path])
    assert "control: 0 failures" in r.stdout, r.stdout



@pytest.mark.gpu
@pytest.mark.skipif(gpu_torch() is None, reason="torch with CUDA and a GPU are needed: "
                                                "scripts/gpu_check.sh runs this")
def test_cpp_client_sends_device_tensors_by_cuda_ipc(cpp_build, server_factory, tmp_path):
    """On a GPU (scripts/gpu_check.sh): a torch tensor and an output buffer exported here
    (gpu/ipc.py, as the Python client exports them), sent by the C++ client, which links
    no CUDA, to a KIND_GPU TorchScript model: the output lands in this process's tensor,
    the same request with an arena output gives the same bytes, and a buffer too small
    is OUTPUT_TOO_SMALL (clients/cpp/tests/test_client.cpp, device mode)."""
    torch = gpu_torch()
    from test_gpu_ipc import AFFINE

    from shmserve.gpu import ipc

    server = server_factory(setup=lambda repo: write_affine(repo, torch, AFFINE))
    x = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(4, 1024)
    out = torch.full_like(x, -1.0)
    src, dst = ipc.DeviceSource(x, "x"), ipc.DeviceSource(out, "out")
    events = ipc.SlotEvents()
    try:
        event = events.record(0, [src])  # on x's producing stream, after its writes
        (tmp_path / "device.txt").write_text(
            f"x {src.handle.hex()} {src.ptr - src.base} {src.uuid.hex()} {src.ordinal} "
            f"{event.hex() if event else '-'} 4 1024\n"
            f"out {dst.handle.hex()} {dst.ptr - dst.base} {dst.uuid.hex()} {dst.ordinal} "
            f"{dst.nbytes}\n")
        r = _run([cpp_build / "shmserve_cpp_tests", "device", "--socket", server.socket_path,
                  "--dir", tmp_path])
    finally:
        events.close()
    assert "device: 0 failures" in r.stdout, r.stdout + r.stderr
    want = x * 2 + 1
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert (tmp_path / "arena.bin").read_bytes() == want.cpu().numpy().tobytes()
