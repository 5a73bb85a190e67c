"""Issue 13: `shmserve status`, the live view. A frame rendered from fixed status
replies (no server) gives the rates and interval quantiles computed by hand; against
real servers (server_factory), --once shows the traffic of a thread, the states and
the client, and exits 2 when no server answers; the live view survives its server."""
from __future__ import annotations

import io
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import wait_until
from rich.console import Console
from test_metrics import setup_models

from shmserve import status as S

pytestmark = pytest.mark.timeout(120)


def status_cmd(server, *args: str, name: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmserve.cli", "status", "--name",
                           name or server.name, *args],
                          capture_output=True, text=True, timeout=60, env=server.env())


def table_rows(text: str, first_header: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header cells, {first cell: cells}) of the rich table whose header starts with
    `first_header` in rendered text (columns separated by │, or | in ASCII)."""
    lines = [line.replace("|", "│") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines)
                 if line.split("│")[0].strip() == first_header and "│" in line)
    head = [c.strip() for c in lines[start].split("│")]
    rows = {}
    for line in lines[start + 1:]:
        if "│" not in line:
            if line.strip() and rows:
                break  # the next block
            continue
        cells = [c.strip() for c in line.split("│")]
        if cells[0] and not set(cells[0]) <= set("─╶╴-+"):
            rows[cells[0]] = cells
    return head, rows


# ---------------------------------------------------------------- a frame, no server

def model_stat(name: str, uptime_hist: list, *, inferences: int, success: int, fail: int = 0,
               queue_ns: int = 0, infer_ns: int = 0, state: str = "READY",
               failures: dict | None = None) -> dict:
    """A model_stat of the status reply, in the shape Coordinator.server_status sends."""
    zero = {"count": 0, "ns": 0}
    requests = success + fail
    return {
        "name": name, "version": "1", "inference_count": inferences, "execution_count": requests,
        "inference_stats": {"success": {"count": success, "ns": 0},
                            "fail": {"count": fail, "ns": 0},
                            "queue": {"count": requests, "ns": queue_ns},
                            "compute_input": zero, "compute_output": zero,
                            "compute_infer": {"count": requests, "ns": infer_ns}},
        "shmserve": {"state": state, "pending": 0,
                     "failures": {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 0,
                                  **(failures or {})},
                     "histograms": {"success": uptime_hist},
                     "instances": [{"instance": 0, "pid": 10, "state": "BUSY", "restarts": 1,
                                    "executions": requests,
                                    "wakeups": {"SPIN": 0, "SLEEP": 0}}]}}


def reply(uptime_s: float, models: list[dict]) -> dict:
    return {"models": models, "broken": [], "ring_depth": 3, "ring_capacity": 2048,
            "clients": [{"client": 0, "pid": 4242, "uid": 0, "slots": 32, "slots_in_use": 5,
                         "arena_bytes": 1 << 20, "bytes_in_flight": 8192}],
            "max_clients": 64, "uptime_s": uptime_s,
            "batcher": {"pid": 99, "restarts": 0, "wakeups": {"SPIN": 7, "SLEEP": 8}},
            "cpu_watch": {"crowded": True, "cpus": 2, "changes": 1, "free_cpus": 0.42,
                          "interval_ms": 100}}


def bucket(b: int) -> tuple[int, int]:
    """[low, high) in ns of latency bucket b (csrc/shms_stats.h: exact below 8, then
    8 buckets per power of two), written out here rather than taken from the code."""
    if b < 8:
        return b, b + 1
    shift = b // 8 - 1
    low = (8 + b % 8) << shift
    return low, low + (1 << shift)


def render_text(now: dict, before: dict | None) -> str:
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(S.render("srv", now, before))
    return out.getvalue()


def test_frame_rates_and_interval_quantiles_from_fixed_replies():
    # before: 1000 slow requests (bucket 150); in the 2 s since: 98 in bucket 80, 2 in 120
    before = reply(10.0, [
        model_stat("busy", [[150, 1000]], inferences=4000, success=1000, queue_ns=10**9,
                   infer_ns=10**9),
        model_stat("idle", [[64, 10]], inferences=10, success=10, queue_ns=50_000,
                   infer_ns=20_000)])
    now = reply(12.0, [
        model_stat("busy", [[80, 98], [120, 2], [150, 1000]], inferences=4300, success=1100,
                   fail=4, queue_ns=10**9 + 104 * 3_000, infer_ns=10**9 + 104 * 7_000,
                   failures={"BACKEND": 3, "OTHER": 1}),
        before["models"][1],
        model_stat("broken", [], inferences=0, success=0,
                   state="UNAVAILABLE: RuntimeError: cannot load weights")])
    text = render_text(now, before)
    head, rows = table_rows(text, "model")
    col = {h: i for i, h in enumerate(head)}
    busy = rows["busy"]

    low, high = bucket(80)  # rank 50 of 100: inside bucket 80, 50 of its 98
    p50_us = (low + (high - low) * 50 / 98) / 1000
    low, high = bucket(120)  # rank 99: the first of the 2 in bucket 120
    p99_us = (low + (high - low) * 0.5) / 1000
    assert busy[col["p50 us"]] == f"{p50_us:.1f}", text
    assert busy[col["p99 us"]] == f"{p99_us:.1f}", text
    assert float(busy[col["infer/s"]]) == 150.0 and float(busy[col["req/s"]]) == 52.0, text
    assert busy[col["queue us"]] == "3.0" and busy[col["infer us"]] == "7.0", text
    assert busy[col["failures"]] == "BACKEND 3, OTHER 1", text
    assert busy[col["busy/inst"]] == "1/1" and busy[col["restarts"]] == "1", text

    # no request in the interval: rates 0, latencies over the whole run, marked
    idle = rows["idle"]
    low, high = bucket(64)
    assert idle[col["infer/s"]] == "0.0" and idle[col["req/s"]] == "0.0", text
    assert idle[col["p50 us"]] == f"{(low + (high - low) * 0.5) / 1000:.1f}*", text
    assert idle[col["queue us"]] == "5.0*" and idle[col["infer us"]] == "2.0*", text
    assert "* since the start" in text, text
    assert rows["broken"][col["state"]] == "UNAVAILABLE: RuntimeError: cannot load weights"
    assert rows["broken"][col["p50 us"]] == "-", text

    assert "rings 3 / 2048" in text and "clients 1 / 64" in text, text
    assert "batcher pid 99" in text and "spin 7 / sleep 8" in text, text
    assert "CPUs free of other work 0.4 / 2" in text and "spinning off (crowded)" in text, text
    _, clients = table_rows(text, "client")
    assert clients["0"][1:] == ["4242", "5 / 32", "8.0 KiB", "1.0 MiB"], text

    # the first frame (no earlier reply): no rates, latencies since the start
    _, rows = table_rows(render_text(now, None), "model")
    assert rows["busy"][col["infer/s"]] == "-" and rows["busy"][col["p50 us"]].endswith("*")
    # a restarted server (uptime went back): no difference taken across the restart
    _, rows = table_rows(render_text(before, now), "model")
    assert rows["busy"][col["req/s"]] == "-", rows


# ---------------------------------------------------------------- a real server

def test_once_shows_traffic_states_and_the_client(server_factory):
    server = server_factory(models=("simple",), setup=setup_models)
    client = server.client(arena_bytes=1 << 20)
    stop, errors = threading.Event(), []
    with pytest.raises(Exception, match="boom"):  # one failure, counted by reason
        client.infer("raiser", [-np.ones((1, 4), np.float32)])

    def traffic():
        x = np.ones((2, 4), np.float32)
        try:
            while not stop.is_set():
                np.testing.assert_array_equal(client.infer("raiser", [x], copy=True)["OUTPUT0"], x)
        except Exception as e:  # reported by the test, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        r = status_cmd(server, "--once", "--interval", "0.5")
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert r.returncode == 0, (r.stdout, r.stderr)
    head, rows = table_rows(r.stdout, "model")
    col = {h: i for i, h in enumerate(head)}
    assert set(rows) == {"raiser", "simple", "broken"}, r.stdout
    raiser = rows["raiser"]
    assert raiser[col["state"]] == "READY", r.stdout
    assert float(raiser[col["infer/s"]]) > 0 and float(raiser[col["req/s"]]) > 0, r.stdout
    # every request of the interval had 2 rows; a snapshot may fall between a batch's
    # execution count and its answers' count (a few requests at either end of the window)
    assert float(raiser[col["infer/s"]]) == pytest.approx(2 * float(raiser[col["req/s"]]),
                                                          rel=0.02), r.stdout
    assert float(raiser[col["p50 us"]]) <= float(raiser[col["p99 us"]]), r.stdout
    assert raiser[col["failures"]] == "BACKEND 1", r.stdout
    assert rows["simple"][col["state"]] == "READY", r.stdout
    assert rows["simple"][col["infer/s"]] == "0.0", r.stdout
    assert rows["broken"][col["state"]] == "UNAVAILABLE: RuntimeError: cannot load weights", \
        r.stdout

    # the traffic's client, and only it: the viewer holds no lease
    _, clients = table_rows(r.stdout, "client")
    assert list(clients) == [str(client.client_id)], r.stdout
    assert clients[str(client.client_id)][1] == str(os.getpid()), r.stdout
    assert "clients 1 / 64" in r.stdout, r.stdout
    assert server.log().count("lease") == 1, server.log()  # "lease %d opened for pid %d"


def test_once_without_a_server_exits_2(server_factory):
    server = server_factory(models=("identity",))
    r = status_cmd(server, "--once", name=server.name + "-absent")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("shmserve status: no server") and server.name + "-absent" \
        in r.stderr, r.stderr
    r = status_cmd(server, "--once", "--interval", "0")
    assert r.returncode == 1 and "--interval" in r.stderr, r.stderr


class Terminal:
    """A pseudo-terminal for a viewer: unlike a pipe, it gets every frame as drawn."""

    def __init__(self):
        self.master, self.slave = pty.openpty()
        self.seen = ""

    def read(self) -> str:
        """What the viewer drew so far (everything available is read now)."""
        while select.select([self.master], [], [], 0)[0]:
            try:
                self.seen += os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the viewer closed its side
                break
        return self.seen

    def wait_for(self, text: str, timeout: float = 30) -> None:
        wait_until(lambda: text in self.read(), timeout, f"{text!r} on the viewer's terminal",
                   state=lambda: self.seen[-2000:])

    def read_until_exit(self, proc: subprocess.Popen, timeout: float = 30) -> None:
        """Keeps reading until proc ends, so that its last frames never fill the terminal."""
        def ended():
            self.read()
            return proc.poll() is not None
        wait_until(ended, timeout, "the viewer to exit")

    def close(self) -> None:
        os.close(self.master)


def test_live_view_keeps_watching_when_its_server_stops(server_factory):
    """Without --once the view refreshes until interrupted (SIGINT: exit 0); a server
    that goes away is reported in the frame, not as a crash of the viewer."""
    server = server_factory(models=("identity",))
    term = Terminal()
    viewer = subprocess.Popen([sys.executable, "-m", "shmserve.cli", "status", "--name",
                               server.name, "--interval", "0.1"], env=server.env(),
                              stdin=subprocess.DEVNULL, stdout=term.slave, stderr=subprocess.PIPE,
                              text=True)
    os.close(term.slave)
    try:
        term.wait_for(server.name)  # its first frame drawn: from now on it refreshes
        assert server.stop() == 0
        term.wait_for("retrying")  # a refresh found no server
        assert viewer.poll() is None, viewer.communicate()
        viewer.send_signal(signal.SIGINT)
        term.read_until_exit(viewer)
        _, err = viewer.communicate(timeout=30)
    finally:
        if viewer.poll() is None:
            viewer.kill()
            viewer.communicate()
        term.close()
    assert viewer.returncode == 0, (term.seen, err)
