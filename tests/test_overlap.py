"""Two batches deep (docs/architecture.md): while an instance runs a batch, the batcher
gives it the next, which grows with the requests that arrive until the instance takes
it, for a model whose config sets `shmserve.overlap` true (off by default). Order of
events is read from the slots' timestamps (one clock for every process), never a
duration."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import helpers
from helpers import python_config, wait_in_flight, wait_until, write_model
from shmserve.protocol import SlotState, Timestamp
from shmserve.server.repository import ConfigError, load_model

pytestmark = pytest.mark.timeout(120)

SLOW_CODE = '''
import time

class TritonPythonModel:
    def execute(self, inputs):
        time.sleep({seconds})
        return {{"OUTPUT0": inputs["INPUT0"]}}
'''


def write_slow(repo, name: str, seconds: float, overlap: bool = True) -> None:
    extra = ('parameters { key: "shmserve.overlap" value { string_value: "true" } }'
             if overlap else "")  # off by default
    write_model(repo, name, python_config(name, dims=(4,), dynamic_batching=
                                          "{ max_queue_delay_microseconds: 0 }", extra=extra),
                SLOW_CODE.format(seconds=seconds))


def rows(k: int) -> np.ndarray:
    return np.full((1, 4), k, np.float32)


def run_one_then_three(server, client, model: str):
    """A request, then three more while it runs: their results, in that order."""
    first = client.submit(model, {"INPUT0": rows(0)}, copy=True)
    wait_in_flight(server, client, SlotState.RUNNING)
    rest = [client.submit(model, {"INPUT0": rows(k)}, copy=True) for k in (1, 2, 3)]
    results = [f.result(timeout=30) for f in [first] + rest]
    for k, r in enumerate(results):
        np.testing.assert_array_equal(r["OUTPUT0"], rows(k))
    return results


@pytest.fixture
def server(server_factory):
    def setup(repo):
        write_slow(repo, "slow", 0.3)
        write_slow(repo, "slow_serial", 0.3, overlap=False)
    return server_factory(models=("identity",), setup=setup)


def test_the_next_batch_forms_while_the_instance_runs_and_grows_until_taken(server):
    client = server.client()
    first, *rest = run_one_then_three(server, client, "slow")
    t = [r.timestamps_ns for r in (first, *rest)]
    # the three were handed over as one batch before the first batch had ended...
    assert all(s[Timestamp.BATCHED] < first.timestamps_ns[Timestamp.COMPUTE_END] for s in t[1:])
    # ...which ran once the first was done: one execution of three requests
    assert all(s[Timestamp.COMPUTE_START] >= first.timestamps_ns[Timestamp.COMPUTE_END]
               for s in t[1:])
    assert slow_stats(client)["batch_requests"] == {"1": 1, "3": 1}


def test_without_overlap_the_next_batch_forms_when_the_instance_is_idle(server):
    client = server.client()
    first, *rest = run_one_then_three(server, client, "slow_serial")
    assert all(r.timestamps_ns[Timestamp.BATCHED] >= first.timestamps_ns[Timestamp.COMPUTE_END]
               for r in rest)
    assert client.statistics("slow_serial")[0]["shmserve"]["batch_requests"] == {"1": 1, "3": 1}


def slow_stats(client) -> dict:
    return client.statistics("slow")[0]["shmserve"]


def test_a_next_batch_behind_a_dying_worker_runs_on_its_successor(server):
    """SIGKILL of the worker while it runs a batch with the next waiting: the batch it
    ran is answered UNAVAILABLE (its successor's take-over), the next batch runs."""
    client = server.client()
    first = client.submit("slow", {"INPUT0": rows(0)}, copy=True)
    wait_in_flight(server, client, SlotState.RUNNING)
    second = client.submit("slow", {"INPUT0": rows(1)}, copy=True)
    wait_in_flight(server, client, SlotState.RUNNING, SlotState.QUEUED)
    (instance,) = slow_stats(client)["instances"]
    # the second request waits in the worker's mailbox, not in the batcher's queue
    wait_until(lambda: slow_stats(client)["pending"] == 0, 10,
               "the second request to leave the queue", state=lambda: slow_stats(client))
    pid = instance["pid"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match="died"):
        first.result(timeout=60)
    np.testing.assert_array_equal(second.result(timeout=60)["OUTPUT0"], rows(1))
    helpers.assert_serving(client)


@pytest.mark.parametrize("value, want", [("true", True), ("False", False), (None, False)])
def test_the_overlap_parameter(tmp_path, value, want):
    extra = ("" if value is None else
             f'parameters {{ key: "shmserve.overlap" value {{ string_value: "{value}" }} }}')
    write_model(tmp_path, "m", python_config("m", extra=extra), SLOW_CODE.format(seconds=0))
    (spec,) = load_model(tmp_path / "m")
    assert spec.overlap is want


def test_a_bad_overlap_parameter_is_a_config_error_naming_it(tmp_path):
    extra = 'parameters { key: "shmserve.overlap" value { string_value: "maybe" } }'
    write_model(tmp_path, "m", python_config("m", extra=extra), SLOW_CODE.format(seconds=0))
    with pytest.raises(ConfigError, match='"shmserve.overlap" must be "true" or "false"'):
        load_model(tmp_path / "m")
