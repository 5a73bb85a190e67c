"""Model control (Triton's model management): --model-control-mode none|explicit|poll,
--load-model, load / unload / reload and the repository index through the Python
client, the CLI and the HTTP front; stale model handles after a reload or an unload;
unloads that drain; loads and unloads under traffic on another model; poll mode."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import shmserve
from shmserve import errors
from helpers import (BROKEN_INIT_CODE, IDENTITY_CODE, SLEEPER_CODE, VERSIONED_CODE, python_config,
                     wait_until, write_model)

pytestmark = pytest.mark.timeout(240)
EXPLICIT = ["--model-control-mode", "explicit"]


def versioned_config(name: str = "versioned", extra: str = "") -> str:
    return python_config(name, "INT32", (-1,), dynamic_batching=None, extra=extra)


def with_versioned(repo):
    write_model(repo, "versioned", versioned_config(), VERSIONED_CODE)


def with_sleeper(repo):
    write_model(repo, "sleeper", python_config("sleeper", dynamic_batching=None), SLEEPER_CODE)


def cli(server, *args, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "shmserve.cli", *args, "--name", server.name],
                          capture_output=True, text=True, timeout=timeout)


def index(c) -> dict:
    return {(r["name"], r["version"]): (r["state"], r["reason"])
            for r in c.get_model_repository_index()}


def ones(n: int = 4) -> np.ndarray:
    return np.ones((1, n), np.int32)


def test_none_mode_refuses_load_and_unload(server_factory):
    server = server_factory(models=("identity", "simple"))
    with shmserve.Client(server.name) as c:
        for op in (lambda: c.load_model("identity"), lambda: c.unload_model("identity")):
            with pytest.raises(errors.UnavailableError,
                               match="explicit model load / unload is not allowed"):
                op()
        assert index(c) == {("identity", "1"): ("READY", ""), ("simple", "1"): ("READY", "")}
        x = np.ones((1, 16), np.int32)
        assert (c.infer("simple", {"INPUT0": x, "INPUT1": x})["OUTPUT0"] == 2).all()
    r = cli(server, "unload", "simple")
    assert r.returncode == 1 and "not allowed" in r.stderr, (r.stdout, r.stderr)


def start_refused(server) -> str:
    """Starts a server that must refuse to start (exit 2); its stderr. One that serves
    after all is stopped cleanly (SIGTERM), then the caller's assertion fails."""
    proc = subprocess.Popen(server.command(), env=server.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    return f"exit {proc.returncode}: {err}"


def test_model_control_flags_are_checked(server_factory):
    for args, words in ((["--load-model", "identity"],
                         "--load-model is only for --model-control-mode explicit"),
                        (["--model-control-mode", "poll", "--repository-poll-secs", "0"],
                         "--repository-poll-secs 0: poll mode needs a period > 0"),
                        (["--model-control-mode", "explicit", "--load-model", "*",
                          "--model-table-size", "0"], "--model-table-size 0")):
        out = start_refused(server_factory(args=args, start=False))
        assert out.startswith("exit 2:") and words in out, (args, out)


def test_explicit_mode_cli_and_client(server_factory):
    server = server_factory(models=("identity", "simple"), setup=with_versioned,
                            args=EXPLICIT + ["--load-model", "simple"])
    r = cli(server, "index")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()[1:]}
    assert rows["simple"] == ["1", "READY"] and rows["identity"] == ["-", "-"], r.stdout
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.UnavailableError, match="'identity' is not loaded"):
            c.infer("identity", {"INPUT0": np.ones((1, 4), np.float32)})
        r = cli(server, "load", "identity")
        assert r.returncode == 0 and "model 'identity' loaded" in r.stdout, r.stderr
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        assert (c.infer("identity", {"INPUT0": x})["OUTPUT0"] == x).all()
        c.load_model("versioned")
        assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()
        r = cli(server, "index", "--json")
        assert r.returncode == 0, r.stderr
        assert {"name": "versioned", "version": "1", "state": "READY"} in json.loads(r.stdout)
        r = cli(server, "unload", "identity")
        assert r.returncode == 0 and "unloaded" in r.stdout, r.stderr
        with pytest.raises(errors.UnavailableError, match="model 'identity' version 1 was unloaded"):
            c.infer("identity", {"INPUT0": x})
        assert index(c)[("identity", "")] == ("UNAVAILABLE", "unloaded")
        assert [r["name"] for r in c.get_model_repository_index(ready=True)] == \
            ["simple", "versioned"]
        with pytest.raises(errors.ModelNotFoundError, match="failed to load 'nosuch'"):
            c.load_model("nosuch")
    assert "model unloaded: 'identity' version 1" in server.log()


def test_stale_handle_after_reload_and_unload(server_factory):
    """A client that resolved a model before another reloaded it is sent to the new
    model transparently (the server refused the old handle before running anything);
    with re-resolution off, the error says what happened. After an unload the old
    handle gets the unload's error, naming the model."""
    server = server_factory(models=(), setup=with_versioned, args=EXPLICIT + ["--load-model",
                                                                             "versioned"])
    with shmserve.Client(server.name) as a, shmserve.Client(server.name) as b:
        assert (a.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()
        old_id = a.model_metadata("versioned")["id"]
        # reload with a configuration override (Triton's load API `config`)
        cfg = {"name": "versioned", "backend": "python", "max_batch_size": 4,
               "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-1]}],
               "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [-1]}]}
        b.load_model("versioned", config=cfg)
        assert b.model_metadata("versioned")["max_batch_size"] == 4
        assert b.model_metadata("versioned")["id"] != old_id
        # a's plan still holds the old handle: re-resolved on the refusal, both paths
        assert (a.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()
        b.load_model("versioned", config=json.dumps({**cfg, "max_batch_size": 2}))
        assert (a.submit("versioned", {"INPUT0": ones()}).result(60)["OUTPUT0"] == 2).all()
        b.load_model("versioned")  # back to config.pbtxt
        a.engine._resolve_again = lambda req, message: None  # re-resolution off
        with pytest.raises(errors.UnavailableError,
                           match=r"model 'versioned' version 1 was reloaded: resolve the model "
                                 r"name again \(stale model id 0x"):
            a.infer("versioned", {"INPUT0": ones()})
        del a.engine._resolve_again
        assert (a.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()  # resolved
        b.unload_model("versioned")
        with pytest.raises(errors.UnavailableError,
                           match=r"model 'versioned' version 1 was unloaded \(stale model id"):
            a.infer("versioned", {"INPUT0": ones()})


@pytest.mark.parametrize("batcher_killed", [False, True], ids=["", "batcher-killed"])
def test_unload_drains_in_flight_requests(server_factory, batcher_killed):
    """Requests the server holds when an unload starts are answered; later ones are
    refused naming the unload. With batcher-killed, kill -9 of the batcher while two
    wait: its successor takes them again under the handle the unload withdrew."""
    server = server_factory(models=("identity",), setup=with_sleeper,
                            args=EXPLICIT + ["--load-model", "*"])
    with shmserve.Client(server.name) as a, shmserve.Client(server.name) as b:
        # seconds each; with a kill, the first runs long enough for the kill to find the
        # other two still queued
        xs = [np.full((1, 2), s, np.float32)
              for s in ((3.0, 0.3, 0.3) if batcher_killed else (0.3, 0.3, 0.3))]
        x = xs[-1]
        futures = [a.submit("sleeper", {"INPUT0": v}) for v in xs]
        # one executes, two wait in the batcher's queue: all three are the server's now
        wait_until(lambda: b.statistics("sleeper")[0]["shmserve"]["pending"] >= 2, 60,
                   "two requests queued")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            unload = pool.submit(b.unload_model, "sleeper")
            # (asked on a's connection: b's waits for the unload)
            wait_until(lambda: index(a).get(("sleeper", "1"), ("",))[0] == "UNLOADING", 60,
                       "sleeper UNLOADING", state=lambda: index(a))
            if batcher_killed:
                kill_batcher(server)
            with pytest.raises(errors.UnavailableError, match="'sleeper' version 1 was unloaded"):
                a.infer("sleeper", {"INPUT0": x})
            for f, v in zip(futures, xs):  # in flight before the unload: answered
                np.testing.assert_array_equal(f.result(60)["OUTPUT0"], v)
            unload.result(60)
        assert (a.infer("identity", {"INPUT0": x})["OUTPUT0"] == x).all()
    log = server.log()
    assert log.index("model unloading: 'sleeper'") < log.index("model unloaded: 'sleeper'")
    if batcher_killed:
        assert "recovered 2 request(s) held by the previous batcher" in log, log


def kill_batcher(server) -> None:
    """kill -9 of the server's batcher; returns once the coordinator started another."""
    from test_lifecycle import _batcher_pid

    batcher = _batcher_pid(server)
    os.kill(batcher, signal.SIGKILL)

    def restarted():
        try:
            return _batcher_pid(server) != batcher
        except AssertionError:  # none between the kill and the restart
            return False
    wait_until(restarted, 60, "a new batcher")


def test_load_unload_under_traffic_loses_nothing(server_factory):
    server = server_factory(models=("identity", "simple"), setup=with_versioned,
                            args=EXPLICIT + ["--load-model", "identity"])
    stop, answered, failures = threading.Event(), [0], []

    def traffic():
        with shmserve.Client(server.name) as c:
            n = 0
            while not stop.is_set():
                x = np.full((1, 8), n, np.float32)
                try:
                    f = c.submit("identity", {"INPUT0": x})
                    y = c.infer("identity", {"INPUT0": x + 1})["OUTPUT0"]
                    if not ((f.result(30)["OUTPUT0"] == x).all() and (y == x + 1).all()):
                        failures.append(f"wrong answer at {n}")
                except Exception as e:  # every one counts: none may fail
                    failures.append(repr(e))
                n += 1
                answered[0] += 2

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with shmserve.Client(server.name) as c:
            for cycle in range(3):
                c.load_model("simple")
                c.load_model("versioned", config=json.loads(json.dumps({
                    "name": "versioned", "backend": "python", "max_batch_size": 8 - cycle,
                    "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [-1]}],
                    "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [-1]}]})))
                x = np.ones((1, 16), np.int32)
                assert (c.infer("simple", {"INPUT0": x, "INPUT1": x})["OUTPUT0"] == 2).all()
                assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()
                c.unload_model("simple")
            wait_until(lambda: answered[0] > 100, 60, "traffic on identity")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:5]
    assert answered[0] > 100


def test_failed_load_is_unavailable_and_others_serve(server_factory):
    def setup(repo):
        with_versioned(repo)
        write_model(repo, "broken", python_config("broken"), BROKEN_INIT_CODE)
        write_model(repo, "badconfig", "name: \"badconfig\"\nmax_batch_size: [\n", IDENTITY_CODE)

    server = server_factory(models=("identity",), setup=setup,
                            args=EXPLICIT + ["--load-model", "identity", "--load-model",
                                             "versioned"])
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.InvalidArgumentError,
                           match="load failed for model 'broken': version 1: .*cannot load weights"):
            c.load_model("broken")
        with pytest.raises(errors.InvalidArgumentError, match=r"badconfig/config.pbtxt:2"):
            c.load_model("badconfig")
        rows = index(c)
        assert rows[("broken", "1")][0] == "UNAVAILABLE"
        assert "cannot load weights" in rows[("broken", "1")][1]
        assert rows[("badconfig", "")][0] == "UNAVAILABLE"
        with pytest.raises(errors.UnavailableError, match="'broken' version 1 is UNAVAILABLE"):
            c.infer("broken", {"INPUT0": np.ones((1, 2), np.float32)})
        x = np.ones((1, 2), np.float32)
        assert (c.infer("identity", {"INPUT0": x})["OUTPUT0"] == x).all()
        # a reload that fails leaves the loaded model serving, unchanged (Triton's rule)
        (server.repo / "versioned" / "1" / "model.py").write_text(BROKEN_INIT_CODE)
        with pytest.raises(errors.InvalidArgumentError, match="cannot load weights"):
            c.load_model("versioned")
        assert index(c)[("versioned", "1")] == ("READY", "")
        assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()


def test_model_table_full_names_the_flag(server_factory):
    server = server_factory(models=("identity", "simple"),
                            args=EXPLICIT + ["--load-model", "simple", "--model-table-size", "1"])
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.BusyError, match="--model-table-size"):
            c.load_model("identity")
        c.unload_model("simple")
        c.load_model("identity")  # the entry is free again
        x = np.ones((1, 2), np.float32)
        assert (c.infer("identity", {"INPUT0": x})["OUTPUT0"] == x).all()


def test_poll_mode_picks_up_versions_configs_and_removals(server_factory):
    server = server_factory(models=("identity",), setup=with_versioned,
                            args=["--model-control-mode", "poll", "--repository-poll-secs",
                                  "0.2"])
    model_dir = server.repo / "versioned"
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.UnavailableError, match="not allowed"):
            c.load_model("versioned")
        assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 2).all()
        # a new version directory: the policy (latest 1) serves it, version 1 goes
        (model_dir / "2").mkdir()
        (model_dir / "2" / "model.py").write_text(VERSIONED_CODE)
        wait_until(lambda: index(c).get(("versioned", "2"), ("",))[0] == "READY"
                   and ("versioned", "1") not in index(c), 60, "version 2 alone",
                   state=lambda: index(c))
        assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 3).all()
        # an edited config.pbtxt: reloaded
        (model_dir / "config.pbtxt").write_text(
            versioned_config().replace("max_batch_size: 8", "max_batch_size: 3"))
        wait_until(lambda: c.model_metadata("versioned")["max_batch_size"] == 3, 60,
                   "the edited config served")
        assert (c.infer("versioned", {"INPUT0": ones()})["OUTPUT0"] == 3).all()
        # a model directory that goes: unloaded; the others serve on
        import shutil
        shutil.rmtree(model_dir)
        wait_until(lambda: index(c).get(("versioned", ""), ("", ""))[1] == "unloaded", 60,
                   "versioned unloaded", state=lambda: index(c))
        x = np.ones((1, 2), np.float32)
        assert (c.infer("identity", {"INPUT0": x})["OUTPUT0"] == x).all()
    log = server.log()
    assert "repository poll: model 'versioned' changed" in log
    assert "repository poll: model 'versioned' was removed" in log


def test_http_repository_extension(server_factory):
    th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
    from tritonclient.utils import InferenceServerException
    from test_http_front import free_port, wait_live

    port = free_port()
    server = server_factory(models=("identity", "simple"),
                            setup=lambda repo: write_model(repo, "broken", python_config(
                                "broken"), BROKEN_INIT_CODE),
                            args=EXPLICIT + ["--load-model", "simple", "--http-port", str(port)])
    client = wait_live(server, port)
    try:
        rows = {r["name"]: r for r in client.get_model_repository_index()}
        assert rows["simple"] == {"name": "simple", "version": "1", "state": "READY"}
        assert rows["identity"] == {"name": "identity"}  # never loaded: its name only
        assert not client.is_model_ready("identity")
        client.load_model("identity")
        assert client.is_model_ready("identity")
        x = np.ones((1, 3), np.float32)
        inp = th.InferInput("INPUT0", [1, 3], "FP32")
        inp.set_data_from_numpy(x)
        assert (client.infer("identity", [inp]).as_numpy("OUTPUT0") == x).all()
        cfg = json.loads(json.dumps({
            "name": "identity", "backend": "python", "max_batch_size": 5,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}))
        client.load_model("identity", config=json.dumps(cfg))
        assert client.get_model_config("identity")["max_batch_size"] == 5
        assert (client.infer("identity", [inp]).as_numpy("OUTPUT0") == x).all()
        client.unload_model("identity")
        assert not client.is_model_ready("identity")
        ready = client.get_model_repository_index()
        assert {"name": "identity", "state": "UNAVAILABLE", "reason": "unloaded"} in ready
        with pytest.raises(InferenceServerException, match="cannot load weights") as e:
            client.load_model("broken")
        assert e.value.status() == "400"
    finally:
        client.close()


def test_ensemble_loaded_while_serving_is_checked_against_served_models(server_factory):
    from test_ensemble import composed, pipeline_repo

    server = server_factory(models=(), setup=pipeline_repo,
                            args=EXPLICIT + ["--load-model", "add_one", "--load-model", "double"])
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"load failed for model 'pipeline': version 1: .*'combine'.*no "
                                 r"such model is served"):
            c.load_model("pipeline")
        assert index(c)[("pipeline", "1")][0] == "UNAVAILABLE"
        c.load_model("combine")
        c.load_model("pipeline")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(c.infer("pipeline", {"INPUT": x})["OUTPUT"], composed(x))


def test_unload_dependents_takes_the_ensembles_calling_the_model(server_factory):
    """Triton's unload_dependents: without it an ensemble stays loaded and its requests
    fail naming the missing step; with it (Python client, HTTP, gRPC) the ensembles that
    call the model go too, and the other steps' models stay."""
    th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
    tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
    import test_grpc_front
    import test_http_front
    from test_ensemble import composed, pipeline_repo

    http_port, grpc_port = test_http_front.free_port(), test_http_front.free_port()
    server = server_factory(models=(), setup=pipeline_repo,
                            args=EXPLICIT + ["--load-model", "*", "--http-port", str(http_port),
                                             "--grpc-port", str(grpc_port)])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with shmserve.Client(server.name) as c:
        c.unload_model("double")
        assert index(c)[("pipeline", "1")] == ("READY", "")
        with pytest.raises(errors.ShmServeError, match=r"pipeline.*step 1 \(model 'double'"):
            c.infer("pipeline", {"INPUT": x})
        c.load_model("double")
        np.testing.assert_array_equal(c.infer("pipeline", {"INPUT": x})["OUTPUT"], composed(x))

        c.unload_model("double", unload_dependents=True)
        assert index(c)[("pipeline", "")] == ("UNAVAILABLE", "unloaded")
        assert index(c)[("add_one", "1")] == ("READY", "")
        assert index(c)[("combine", "1")] == ("READY", "")
        for module, port, step in ((test_http_front, http_port, "add_one"),
                                   (test_grpc_front, grpc_port, "combine")):
            c.load_model("double")
            c.load_model("pipeline")
            client = module.wait_live(server, port)
            try:
                client.unload_model(step, unload_dependents=True)  # tritonclient's API
                assert not client.is_model_ready("pipeline") and not client.is_model_ready(step)
                assert client.is_model_ready("double")
            finally:
                client.close()
            c.load_model(step)


def test_grpc_repository_extension(server_factory):
    tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
    from test_grpc_front import wait_live
    from test_http_front import free_port

    port = free_port()
    server = server_factory(models=("identity", "simple"),
                            args=EXPLICIT + ["--load-model", "simple", "--grpc-port", str(port)])
    client = wait_live(server, port)
    try:
        rows = {m.name: m for m in client.get_model_repository_index(as_json=False).models}
        assert rows["simple"].state == "READY" and rows["identity"].state == ""
        client.load_model("identity", config=json.dumps({
            "name": "identity", "backend": "python", "max_batch_size": 5,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}))
        assert client.is_model_ready("identity")
        assert client.get_model_config("identity", as_json=True)["config"]["max_batch_size"] == 5
        x = np.ones((1, 3), np.float32)
        inp = tg.InferInput("INPUT0", [1, 3], "FP32")
        inp.set_data_from_numpy(x)
        assert (client.infer("identity", [inp]).as_numpy("OUTPUT0") == x).all()
        client.unload_model("identity")
        assert not client.is_model_ready("identity")
        rows = {m.name: m for m in client.get_model_repository_index(as_json=False).models}
        assert (rows["identity"].state, rows["identity"].reason) == ("UNAVAILABLE", "unloaded")
    finally:
        client.close()



# Triton's load with "file:<path>" parameters: the model comes in the request.
FILES_CONFIG = json.dumps({"name": "fresh", "backend": "onnxruntime", "max_batch_size": 8,
                           "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [256]}],
                           "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}]})


def files_root(server):
    return server.runtime_dir / f"{server.name}.models"


def mlp_reference(mlp_onnx, x):
    import onnxruntime as ort
    session = ort.InferenceSession(str(mlp_onnx), providers=["CPUExecutionProvider"])
    return session.run(None, {"INPUT0": x})[0]


def test_load_with_model_files_serves_them(server_factory, mlp_onnx):
    server = server_factory(models=("identity",), args=EXPLICIT)
    onnx_bytes = mlp_onnx.read_bytes()
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    with shmserve.Client(server.name) as c:
        with pytest.raises(errors.InvalidArgumentError, match="need the 'config' parameter too"):
            c.load_model("fresh", files={"file:1/model.onnx": onnx_bytes})
        for path in ("../evil/model.onnx", "/tmp/model.onnx", "1/../../x"):
            with pytest.raises(errors.InvalidArgumentError,
                               match=rf"'file:{path}' must name a path inside the model directory"):
                c.load_model("fresh", FILES_CONFIG, files={f"file:{path}": onnx_bytes})
        with pytest.raises(ValueError, match="keys are 'file:<path>'"):
            c.load_model("fresh", FILES_CONFIG, files={"1/model.onnx": onnx_bytes})
        c.load_model("fresh", FILES_CONFIG, files={"file:1/model.onnx": onnx_bytes})
        assert index(c)[("fresh", "1")] == ("READY", "")
        np.testing.assert_allclose(c.infer("fresh", [x])["OUTPUT0"], mlp_reference(mlp_onnx, x),
                                   rtol=1e-5, atol=1e-5)
        assert [d.name for d in files_root(server).iterdir()]  # kept while it serves
        with pytest.raises(errors.InvalidArgumentError, match="exceeds the control protocol's"):
            c.load_model("fresh", FILES_CONFIG, files={"file:1/model.onnx": bytes(17 << 20)})
        c.unload_model("fresh")
        assert list(files_root(server).iterdir()) == []  # unloaded: its files go
        c.load_model("fresh", FILES_CONFIG, files={"file:1/model.onnx": onnx_bytes})
        assert index(c)[("fresh", "1")] == ("READY", "")
    server.stop()
    assert not files_root(server).exists()


def test_front_loads_carry_model_files(server_factory, mlp_onnx):
    th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
    tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
    import test_grpc_front
    import test_http_front

    http_port, grpc_port = test_http_front.free_port(), test_http_front.free_port()
    server = server_factory(models=(), args=EXPLICIT + ["--http-port", str(http_port),
                                                        "--grpc-port", str(grpc_port)])
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    want = mlp_reference(mlp_onnx, x)
    files = {"file:1/model.onnx": mlp_onnx.read_bytes()}
    for module, tc, port in ((test_http_front, th, http_port), (test_grpc_front, tg, grpc_port)):
        client = module.wait_live(server, port)
        try:
            client.load_model("fresh", config=FILES_CONFIG, files=files)  # tritonclient's API
            assert client.is_model_ready("fresh")
            inp = tc.InferInput("INPUT0", [1, 256], "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_allclose(client.infer("fresh", [inp]).as_numpy("OUTPUT0"), want,
                                       rtol=1e-5, atol=1e-5)
            client.unload_model("fresh")
        finally:
            client.close()
