"""Fair share between callers (issue 14): within a priority level the clients take
turns (scheduling/fair.py), each client's requests in arrival order; priorities
still come first; dynamic batching's delay counts from the model's oldest request;
the per-client limit (--max-queued-per-client, model parameter
shmserve.max_queued_per_client) refuses one client's excess and nobody else's.

Determinism: the server tests hold the model's one instance on a gate (a file the
test creates) while the queue fills, wait until the batcher holds every request
(the model's pending count), and read the order the model ran them in. The unit
tests drive the schedulers with given times. Nothing asserts a duration."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from helpers import python_config, wait_until, write_model
from shmserve import errors
from shmserve.cli import _request_count
from shmserve.errors import ConfigError
from shmserve.protocol import Status
from shmserve.server.repository import ModelSpec, TensorSpec, load_model
from shmserve.server.scheduling import Pending, make_scheduler

pytestmark = pytest.mark.timeout(180)
US = 1000  # ns


# -- unit tests: the schedulers -------------------------------------------------------

def spec(max_batch=1, delay_us=0, dynamic=True, priority_levels=0, per_client=None) -> ModelSpec:
    t = TensorSpec("INPUT0", 11, (-1,))
    return ModelSpec(name="m", version=1, backend="python", path="/x", max_batch_size=max_batch,
                     inputs=(t,), outputs=(t,), instance_count=1, dynamic_batching=dynamic,
                     preferred_batch_sizes=(), max_queue_delay_us=delay_us, parameters={},
                     config_text="", priority_levels=priority_levels,
                     default_priority_level=1 if priority_levels else 0,
                     max_queued_per_client=per_client)


def tagged(client: int, i: int, at_us=0, key=b"a", priority=0) -> Pending:
    """A request whose shadow number says who sent it: client * 1000 + i."""
    return Pending(client * 1000 + i, 1, key, at_us * US, None, 0, priority=priority, client=client)


def run_all(q, now_us=10**6) -> list[list[int]]:
    """Every batch the scheduler forms, as shadow numbers, until it holds none."""
    batches = []
    while len(q):
        batch, _ = q.next_batch(now_us * US)
        assert batch is not None
        batches.append([p.shadow for p in batch])
    return batches


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_flood_of_one_client_does_not_put_another_behind_all_of_it(dynamic):
    q = make_scheduler(spec(dynamic=dynamic))
    for i in range(64):
        assert q.enqueue(tagged(1, i, at_us=i)) is None
    assert q.enqueue(tagged(2, 0, at_us=100)) is None
    order = [b[0] for b in run_all(q)]
    assert order[:3] == [1000, 2000, 1001]  # the polite one in the second turn
    assert order == [1000, 2000] + [1000 + i for i in range(1, 64)]


def test_clients_take_turns_and_each_keeps_its_own_order():
    """Three clients with 5, 3 and 1 requests, arrivals interleaved: one request a
    turn, a client that runs out leaves the turns, a newcomer joins at the back."""
    q = make_scheduler(spec())
    arrivals = [(1, 0), (1, 1), (2, 0), (1, 2), (3, 0), (2, 1), (1, 3), (2, 2), (1, 4)]
    for t, (client, i) in enumerate(arrivals):
        q.enqueue(tagged(client, i, at_us=t))
    first = q.next_batch(10**6 * US)[0]
    assert [p.shadow for p in first] == [1000]
    q.enqueue(tagged(4, 0, at_us=50))  # joins behind clients 2, 3 and 1
    order = [first[0].shadow] + [b[0] for b in run_all(q)]
    assert order == [1000, 2000, 3000, 1001, 4000, 2001, 1002, 2002, 1003, 1004]
    for client in (1, 2, 3, 4):
        own = [s for s in order if s // 1000 == client]
        assert own == sorted(own), f"client {client}'s own order changed: {own}"


def test_batches_take_requests_in_turns():
    """A batch of 4 rows out of a flood of 10 and two single requests holds both."""
    q = make_scheduler(spec(max_batch=4))
    for i in range(10):
        q.enqueue(tagged(1, i, at_us=i))
    q.enqueue(tagged(2, 0, at_us=20))
    q.enqueue(tagged(3, 0, at_us=21))
    assert run_all(q) == [[1000, 2000, 3000, 1001], [1002, 1003, 1004, 1005],
                          [1006, 1007, 1008, 1009]]


def test_priorities_come_before_fair_share():
    """Level 1 first, whoever sent it; within each level the clients take turns."""
    q = make_scheduler(spec(priority_levels=2))
    for i in range(3):
        q.enqueue(tagged(1, i, at_us=i, priority=1))  # the flooder's, urgent
    for i in range(3, 6):
        q.enqueue(tagged(1, i, at_us=i, priority=2))
    q.enqueue(tagged(2, 0, at_us=10, priority=2))  # polite, not urgent
    q.enqueue(tagged(2, 1, at_us=11, priority=1))  # polite, urgent
    order = [b[0] for b in run_all(q)]
    assert order == [1000, 2001, 1001, 1002, 1003, 2000, 1004, 1005]


def test_queue_delay_counts_from_the_oldest_request_of_the_model():
    """The client whose turn it is may hold a newer request than another's: the delay
    runs from the model's oldest, so turns never make a batch wait longer."""
    q = make_scheduler(spec(max_batch=8, delay_us=100))
    q.enqueue(tagged(1, 0, at_us=0, key=b"x"))
    q.enqueue(tagged(1, 1, at_us=1, key=b"y"))
    q.enqueue(tagged(2, 0, at_us=5, key=b"y"))
    assert q.next_batch(50 * US) == (None, 100 * US)
    batch, _ = q.next_batch(100 * US)  # client 1's x goes alone: its shapes differ
    assert [p.shadow for p in batch] == [1000]
    # Client 2's turn now (its request from 5 us), but client 1's from 1 us is older.
    assert q.head().shadow == 2000
    assert q.next_batch(100 * US) == (None, 101 * US)
    batch, _ = q.next_batch(101 * US)
    assert [p.shadow for p in batch] == [2000, 1001]


def test_timeouts_and_drain_keep_the_counts():
    """A timed-out request leaves without using its client's turn (client 1 keeps its
    place before client 2); drain returns all, in turn order."""
    s = dataclasses.replace(spec(max_batch=1), queue_timeout_us=10)
    q = make_scheduler(s)
    q.enqueue(tagged(1, 0, at_us=0))
    q.enqueue(tagged(2, 0, at_us=20))
    q.enqueue(tagged(1, 1, at_us=25))
    expired, _ = q.expire(15 * US)
    assert [r.pending.shadow for r in expired] == [1000] and len(q) == 2
    assert [p.shadow for p in q.drain()] == [1001, 2000] and len(q) == 0


def test_the_per_client_limit_refuses_only_that_clients_excess():
    q = make_scheduler(spec(per_client=2))
    assert q.admit(tagged(1, 0)) is None and q.admit(tagged(1, 1)) is None
    refused = q.admit(tagged(1, 2))
    assert refused is not None and refused.status == Status.BUSY
    assert "model 'm'" in refused.message and "max_queued_per_client 2" in refused.message
    assert q.admit(tagged(2, 0)) is None  # another client is untouched
    batch, _ = q.next_batch(0)
    q.left(batch)  # the batcher's call: client 1 has one queued now
    assert q.admit(tagged(1, 3)) is None
    assert q.admit(tagged(1, 4)) is not None
    expired, _ = q.expire(0)
    q.left(r.pending for r in expired)
    q.left(q.drain())
    assert not q.per_client


def test_no_limit_by_default_and_the_parameter_is_checked(tmp_path):
    q = make_scheduler(spec())
    assert q.max_per_client == 0
    for i in range(100):
        assert q.admit(tagged(1, i)) is None
    assert not q.per_client  # nothing counted without a limit

    def config(value):
        return python_config("m", extra='parameters { key: "shmserve.max_queued_per_client" '
                             f'value {{ string_value: "{value}" }} }}')
    write_model(tmp_path, "m", config(" 5 "), "")
    assert load_model(tmp_path / "m")[0].max_queued_per_client == 5
    for bad in ("-1", "many", ""):
        write_model(tmp_path, "m", config(bad), "")
        with pytest.raises(ConfigError, match="shmserve.max_queued_per_client"):
            load_model(tmp_path / "m")
    assert _request_count("8") == 8
    with pytest.raises(argparse.ArgumentTypeError, match="not a number of requests"):
        _request_count("-1")  # serve --max-queued-per-client


# -- server tests: a recording model on a gate ----------------------------------------

# test_priorities' recorder: logs each batch's request tags (parameter "tag") and holds
# the instance while a request has "block", until the file "gate" exists.
from test_priorities import GATED_RECORDER_CODE  # noqa: E402

X = np.ones((1, 1), np.float32)


def ran(model_dir: Path) -> list:
    """The tags of the requests the model ran, in order (its batches flattened)."""
    path = model_dir / "batches.jsonl"
    return [tag for line in (path.read_text().splitlines() if path.exists() else [])
            for tag in json.loads(line)]


def gated_server(server_factory, dynamic="{ }", extra="", args=()):
    def setup(repo):
        write_model(repo, "rec", python_config("rec", max_batch_size=1, dynamic_batching=dynamic,
                                               extra=extra), GATED_RECORDER_CODE)
    server = server_factory(models=(), setup=setup, args=list(args))
    return server, server.repo / "rec"


def hold(c, model_dir: Path):
    blocker = c.submit("rec", {"INPUT0": X}, parameters={"tag": "block", "block": True})
    wait_until(lambda: ran(model_dir) == ["block"], 30, "the blocker running")
    return blocker


def wait_queued(c, n: int) -> None:
    wait_until(lambda: c.statistics("rec")[0]["shmserve"]["pending"] == n, 30,
               f"{n} requests queued", state=lambda: c.statistics("rec")[0]["shmserve"]["pending"])


def test_a_polite_client_is_served_in_the_first_turns_of_a_64_request_flood(server_factory):
    server, model_dir = gated_server(server_factory, args=["--slots-per-client", "72"])
    flooder, polite = server.client(), server.client()
    blocker = hold(flooder, model_dir)
    flood = [flooder.submit("rec", {"INPUT0": X * i}, parameters={"tag": f"f{i}"})
             for i in range(64)]
    wait_queued(flooder, 64)
    mine = polite.submit("rec", {"INPUT0": X * 7}, parameters={"tag": "p"})
    wait_queued(flooder, 65)
    (model_dir / "gate").touch()
    blocker.result(timeout=60)
    assert mine.result(timeout=60)["OUTPUT0"].tolist() == [[7.0]]
    for i, f in enumerate(flood):
        assert f.result(timeout=60)["OUTPUT0"].tolist() == [[float(i)]]
    order = ran(model_dir)
    # The flooder's first request, then the polite one's turn; the flood in its order.
    assert order == ["block", "f0", "p"] + [f"f{i}" for i in range(1, 64)], order


def test_priorities_reorder_before_the_turns(server_factory):
    server, model_dir = gated_server(server_factory, dynamic="""{
      priority_levels: 2 default_priority_level: 2 }""")
    flooder, polite = server.client(), server.client()
    blocker = hold(flooder, model_dir)
    sent = [flooder.submit("rec", {"INPUT0": X}, priority=1, parameters={"tag": f"u{i}"})
            for i in range(3)]
    sent += [flooder.submit("rec", {"INPUT0": X}, priority=2, parameters={"tag": f"f{i}"})
             for i in range(3)]
    wait_queued(flooder, 6)
    sent.append(polite.submit("rec", {"INPUT0": X}, priority=2, parameters={"tag": "p"}))
    wait_queued(flooder, 7)
    (model_dir / "gate").touch()
    blocker.result(timeout=60)
    for f in sent:
        f.result(timeout=60)
    assert ran(model_dir) == ["block", "u0", "u1", "u2", "f0", "p", "f1", "f2"]


def per_client_parameter(value: str) -> str:
    return f'parameters {{ key: "shmserve.max_queued_per_client" value {{ string_value: "{value}" }} }}'


@pytest.mark.parametrize("where", ["flag", "parameter"])
def test_the_per_client_limit_refuses_the_excess_and_serves_the_others(server_factory, where):
    if where == "flag":
        server, model_dir = gated_server(server_factory, args=["--max-queued-per-client", "4"])
    else:  # the model's parameter wins over the server's flag
        server, model_dir = gated_server(server_factory, args=["--max-queued-per-client", "50"],
                                         extra=per_client_parameter("4"))
    flooder, polite = server.client(), server.client()
    blocker = hold(flooder, model_dir)  # running, no longer queued
    flood = [flooder.submit("rec", {"INPUT0": X * i}, parameters={"tag": f"f{i}"})
             for i in range(10)]
    refused = []
    for i, f in enumerate(flood[4:], 4):
        with pytest.raises(errors.BusyError) as e:
            f.result(timeout=60)
        refused.append(i)
        assert "model 'rec'" in str(e.value) and "max_queued_per_client 4" in str(e.value), e.value
    assert refused == list(range(4, 10))
    mine = [polite.submit("rec", {"INPUT0": X}, parameters={"tag": f"p{i}"}) for i in range(2)]
    wait_queued(flooder, 6)
    (model_dir / "gate").touch()
    blocker.result(timeout=60)
    for f in flood[:4] + mine:
        f.result(timeout=60)
    assert ran(model_dir) == ["block", "f0", "p0", "f1", "p1", "f2", "f3"]
    # Its queue emptied, the flooder may queue again.
    assert flooder.infer("rec", {"INPUT0": X * 3}, parameters={"tag": "again"})["OUTPUT0"].tolist() == [[3.0]]


def test_a_model_turns_the_servers_limit_off_with_0(server_factory):
    server, model_dir = gated_server(server_factory, args=["--max-queued-per-client", "2"],
                                     extra=per_client_parameter("0"))
    c = server.client()
    blocker = hold(c, model_dir)
    sent = [c.submit("rec", {"INPUT0": X * i}, parameters={"tag": i}) for i in range(6)]
    wait_queued(c, 6)
    (model_dir / "gate").touch()
    blocker.result(timeout=60)
    assert [f.result(timeout=60)["OUTPUT0"].tolist() for f in sent] == [[[float(i)]] for i in range(6)]


def test_the_per_client_limit_counts_sequence_requests_too():
    """A sequence model's scheduler has no turns (a sequence runs in its slot in arrival
    order) but the limit applies: counted in, counted out by batch and by drain."""
    from test_sequence import seq_spec, sp

    q = make_scheduler(dataclasses.replace(seq_spec(instances=1), max_queued_per_client=2))
    mine = [sp(0, 1, start=True), sp(1, 1), sp(2, 1, end=True)]
    for p in mine:
        p.client = 1
    assert q.admit(mine[0]) is None and q.admit(mine[1]) is None
    refused = q.admit(mine[2])
    assert refused is not None and refused.status == Status.BUSY and "model 's'" in refused.message
    other = sp(3, 2, start=True)
    other.client = 2
    assert q.admit(other) is None
    plan, _ = q.assign(0, [0])
    q.left(p for _, batch in plan for p in batch)
    assert q.per_client == {1: 1}
    assert q.admit(mine[2]) is None
    q.left(q.drain())
    assert not q.per_client
