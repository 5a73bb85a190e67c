"""Failure isolation (issue 10): Triton's --exit-on-error. By default a model that
cannot be loaded stops the start (exit 2) and the log names every broken model; with
--exit-on-error=false the good models are served and each broken one is listed
UNAVAILABLE with its reason, and a request for it is UnavailableError, not NOT_FOUND."""
from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import assert_serving, python_config, write_model

from shmserve import errors
from shmserve.cli import format_models

pytestmark = pytest.mark.timeout(120)

IDENTITY_CODE = "class TritonPythonModel:\n    pass\n"  # loaded, never run


def with_two_broken(repo):
    """Two good bundled models (identity, simple) plus a config that does not parse
    and a model whose version directory lacks its model file."""
    write_model(repo, "bad_pbtxt", 'name: "bad_pbtxt"\nbackend: "python"\nmax_batch_size: eight\n',
                "class TritonPythonModel:\n    pass\n")
    write_model(repo, "no_file", python_config("no_file"), code=None)  # 1/ holds no model.py


BAD_PBTXT = re.compile(r"bad_pbtxt/config\.pbtxt:3:\d+")
NO_FILE = re.compile(r"no_file/1/model\.py: missing \(the model file of version 1")


def test_default_exit_on_error_names_every_broken_model(server_factory):
    server = server_factory(models=("identity", "simple"), setup=with_two_broken, start=False)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        server.start()
    log = server.log()
    assert BAD_PBTXT.search(log), log
    assert NO_FILE.search(log), log
    assert "--exit-on-error=false" in log
    assert not server.socket_path.exists() and not server.record_path.exists()


@pytest.mark.parametrize("spelling", [["--exit-on-error=false"], ["--exit-on-error", "0"],
                                      ["--exit-on-error", "false"]])
def test_exit_on_error_false_serves_the_good_models(server_factory, spelling):
    server = server_factory(models=("identity", "simple"), setup=with_two_broken, args=spelling)
    with server.client(arena_bytes=1 << 20) as c:
        assert_serving(c, "identity")
        models = {m["name"]: m for m in c.models()}
        assert sorted(models) == ["bad_pbtxt", "identity", "no_file", "simple"]
        assert models["identity"]["state"] == "READY" and models["simple"]["state"] == "READY"
        assert models["bad_pbtxt"]["state"].startswith("UNAVAILABLE: ")
        assert BAD_PBTXT.search(models["bad_pbtxt"]["state"]), models["bad_pbtxt"]
        assert NO_FILE.search(models["no_file"]["state"]), models["no_file"]
        table = format_models(c.models(), c.statistics())  # `shmserve models`
        assert re.search(r"bad_pbtxt\s+0\s+UNAVAILABLE", table) and "reason: " in table, table

        with pytest.raises(errors.UnavailableError) as e:
            c.infer("no_file", [np.ones((1, 4), np.float32)])
        assert e.value.code == errors.P.Status.UNAVAILABLE
        assert "'no_file'" in e.value.msg and NO_FILE.search(e.value.msg), e.value.msg
        with pytest.raises(errors.UnavailableError) as e:
            c.model_metadata("bad_pbtxt")
        assert "'bad_pbtxt'" in e.value.msg and BAD_PBTXT.search(e.value.msg), e.value.msg
        with pytest.raises(errors.ModelNotFoundError):  # unknown stays NOT_FOUND
            c.infer("no_such_model", [np.ones((1, 4), np.float32)])
        assert_serving(c, "identity")  # the errors disturb nothing
        out = c.infer("simple", {"INPUT0": np.ones((1, 16), np.int32),
                                 "INPUT1": np.ones((1, 16), np.int32)}, copy=True)
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 16), 2, np.int32))
    assert "UNAVAILABLE" in server.log()


def test_all_models_broken_is_refused_even_without_exit_on_error(server_factory):
    server = server_factory(models=(), setup=with_two_broken, args=["--exit-on-error=false"],
                            start=False)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        server.start()
    log = server.log()
    assert "can be loaded" in log and BAD_PBTXT.search(log) and NO_FILE.search(log), log


def test_scan_repository_reports_each_problem(tmp_path):
    from shmserve.errors import ConfigError
    from shmserve.server.repository import load_repository, scan_repository

    write_model(tmp_path, "good", python_config("good"), IDENTITY_CODE)
    with_two_broken(tmp_path)
    specs, problems = scan_repository(tmp_path)
    assert [s.name for s in specs] == ["good"]
    # the version without its model file is the problem, as Triton fails that version
    assert [(p.name, p.version) for p in problems] == [("bad_pbtxt", None), ("no_file", 1)]
    with pytest.raises(ConfigError) as e:
        load_repository(tmp_path)
    assert BAD_PBTXT.search(e.value.msg) and NO_FILE.search(e.value.msg), e.value.msg


def test_exit_on_error_spellings():
    import argparse

    from shmserve.cli import _bool

    assert [_bool(t) for t in ("true", "1", "True", "false", "0", "FALSE")] == \
        [True, True, True, False, False, False]
    with pytest.raises(argparse.ArgumentTypeError):
        _bool("maybe")
