"""The load: client processes (multiprocessing, spawn) that send requests and
return one record per request.

Each worker opens its own target (a shmserve Client, a tritonclient client),
warms it up, reports ready, then waits for a common start time t0 (CLOCK_MONOTONIC,
the same in every process). It runs one of two loops:

- closed loop (concurrency mode): `concurrency` requests in flight, a new one sent
  as soon as one completes. With one in flight it uses the blocking call (the
  caller thread waits, as an application would); with more, submit() and a queue.
- open loop (request-rate mode): sends at the intended times of its share of a
  Schedule, whether or not earlier requests have completed; a request's latency
  is measured from its intended time.

Records (stats.N_COLS int64 columns: intended, sent, end, ok, 8 slot stamps) go
to the parent at every window boundary t0 + warmup + k * window (k = 0, 1, ...:
boundary 0 ends the warm-up), with the worker's CPU time; the parent answers
"stop" when it has seen enough.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import Counter
from multiprocessing.connection import wait as mp_wait

import numpy as np

from . import stats as S
from .schedule import WorkerSchedule
from .failures import error_text
from .targets import NO_STAMPS, open_target

SPIN_NS = 200_000  # open loop: spin for the last 200 us before a send, sleep before that
POLL_NS = 20_000_000  # a worker looks for "stop" this often


def now_ns() -> int:
    return time.monotonic_ns()  # CLOCK_MONOTONIC on Linux, as protocol.now_ns


class _Worker:
    def __init__(self, conn, spec: dict):
        self.conn, self.spec = conn, spec
        self.recs: list[tuple] = []
        self.errors: Counter = Counter()
        self.stop = False

    # -- talking to the parent -----------------------------------------------------
    def flush(self, boundary: int, final: bool = False) -> None:
        arr = np.array(self.recs, np.int64).reshape(-1, S.N_COLS) if self.recs else S.empty_records()
        self.recs = []
        self.conn.send(("final" if final else "records", boundary, arr, dict(self.errors),
                        time.process_time(), now_ns()))
        self.errors.clear()

    def poll_stop(self) -> None:
        if self.conn.poll():
            msg = self.conn.recv()
            if msg[0] == "stop":
                self.stop = True

    def tick(self, now: int) -> None:
        """Window boundaries and stop messages."""
        if now >= self.next_boundary:
            k = (now - self.w0) // self.window
            self.flush(int(k))
            self.next_boundary = self.w0 + (k + 1) * self.window
            self.poll_stop()
            self.next_poll = now + POLL_NS
        elif now >= self.next_poll:
            self.poll_stop()
            self.next_poll = now + POLL_NS

    # -- the run ------------------------------------------------------------------------
    def run(self) -> None:
        sp = self.spec
        self.target = t = open_target(sp["url"], sp["model"], version=sp.get("version"),
                                      timeout_s=sp.get("timeout_s", 30.0),
                                      options=sp.get("target_options"))
        self.sets = sp["data_sets"]
        in_flight = sp["concurrency"] if sp["mode"] == "concurrency" else sp.get("max_in_flight", 64)
        t.prepare(self.sets, in_flight)
        for i in range(sp.get("warm_requests", 20)):  # connections, caches, first-call costs
            try:
                t.infer(i % len(self.sets))
            except Exception:  # noqa: BLE001 - the measured run counts errors
                break
        self.conn.send(("ready", os.getpid(), getattr(t, "server_pid", lambda: None)()))
        msg = self.conn.recv()
        if msg[0] != "go":
            return
        _, self.t0, warmup_ns, self.window = msg
        self.w0 = self.t0 + warmup_ns
        # boundary 0 (the end of the warm-up) is reported too: its CPU time is where
        # window 1's client CPU starts
        self.next_boundary = self.w0
        self.next_poll = 0
        while now_ns() < self.t0:
            time.sleep(max(0.0, (self.t0 - now_ns()) / 1e9 - 0.0005))
        if sp["mode"] == "rate":
            self.open_loop()
        elif sp["concurrency"] == 1 and not sp.get("force_async"):
            self.closed_sync()
        else:
            self.closed_async()
        self.flush(-1, final=True)

    def closed_sync(self) -> None:
        t, k = self.target, len(self.sets)
        i = 0
        while not self.stop:
            sent = now_ns()
            try:
                stamps, ok = t.infer(i % k) or NO_STAMPS, 1
            except Exception as e:  # noqa: BLE001 - counted
                stamps, ok = NO_STAMPS, 0
                self.errors[error_text(e)] += 1
            end = now_ns()
            self.recs.append((sent, sent, end, ok, *stamps))
            i += 1
            self.tick(end)

    def _done_queue(self):
        q: queue.SimpleQueue = queue.SimpleQueue()

        def submit(i: int, intended: int | None) -> None:
            sent = now_ns()
            if intended is None:  # closed loop: sent when intended
                intended = sent

            def done(ok, err, stamps, end):
                q.put((intended, sent, end, ok, err, stamps))
            try:
                self.target.submit(i, done)
            except Exception as e:  # noqa: BLE001 - refused at once: counted
                q.put((intended, sent, now_ns(), False, error_text(e), None))
        return q, submit

    def _record(self, item) -> None:
        intended, sent, end, ok, err, stamps = item
        if not ok:
            self.errors[err] += 1
        self.recs.append((intended, sent, end, 1 if ok else 0, *(stamps or NO_STAMPS)))

    def _drain(self, q, in_flight: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while in_flight:
            try:
                self._record(q.get(timeout=max(0.0, deadline - time.monotonic())))
                in_flight -= 1
            except queue.Empty:
                self.errors[f"no answer within {timeout_s} s at the end of the run"] += in_flight
                return 0
        return in_flight

    def closed_async(self) -> None:
        q, submit = self._done_queue()
        k, i = len(self.sets), 0
        for _ in range(self.spec["concurrency"]):
            submit(i % k, None)
            i += 1
        in_flight = self.spec["concurrency"]
        while not self.stop:
            try:
                item = q.get(timeout=0.02)
            except queue.Empty:
                self.tick(now_ns())
                continue
            while item is not None:  # everything that completed, before a boundary is sent
                self._record(item)
                submit(i % k, None)
                i += 1
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            self.tick(now_ns())
        self._drain(q, in_flight, self.spec.get("timeout_s", 30.0))

    def open_loop(self) -> None:
        sp = self.spec
        sched = WorkerSchedule(sp["rate"], sp["distribution"], sp.get("seed", 0),
                               sp["workers"], sp["index"])
        q, submit = self._done_queue()
        offsets, pos, i, k, in_flight = sched.next_chunk(), 0, 0, len(self.sets), 0
        while not self.stop:
            intended = self.t0 + int(offsets[pos])
            now = now_ns()
            while True:  # record completions while waiting for the send time
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                self._record(item)
                in_flight -= 1
            self.tick(now)
            if self.stop:
                break
            left = intended - now
            if left > SPIN_NS:
                wait_ns = min(left - SPIN_NS, max(self.next_boundary - now, 0) + 1000, POLL_NS)
                try:
                    self._record(q.get(timeout=wait_ns / 1e9))
                    in_flight -= 1
                except queue.Empty:
                    pass
                continue
            while now_ns() < intended:
                pass
            submit(i % k, intended)
            in_flight += 1
            i += 1
            pos += 1
            if pos == len(offsets):
                offsets, pos = sched.next_chunk(), 0
        self._drain(q, in_flight, sp.get("timeout_s", 30.0))


def worker_main(conn, spec: dict) -> None:
    w = _Worker(conn, spec)
    try:
        w.run()
    except BaseException:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        t = getattr(w, "target", None)
        if t is not None:
            try:
                t.close()
            except Exception:  # noqa: BLE001
                pass
        conn.close()


class WorkerError(RuntimeError):
    pass


class LoadGroup:
    """N worker processes driving one load level; the parent side of the protocol.

        with LoadGroup(specs) as g:
            g.start(warmup_s, window_s)
            for k in count(1): recs, cpu = g.window(k, timeout)
            g.stop()
    """

    def __init__(self, specs: list[dict], start_timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.errors_total: Counter = Counter()
        self.server_pid = None
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.pool = S.empty_records()
        self.reported = [-1] * len(specs)  # highest boundary each worker has reported
        self.cpu = [[] for _ in specs]  # (boundary, process_time, at) per worker
        self.final = [False] * len(specs)
        self.closed = False
        try:
            self._expect_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _recv(self, conn, timeout: float):
        if not conn.poll(timeout):
            return None
        try:
            return conn.recv()
        except EOFError:
            raise WorkerError("a benchmark client process exited unexpectedly") from None

    def _expect_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in self.conns:
            msg = self._recv(c, max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise WorkerError(f"benchmark client not ready within {timeout} s")
            if msg[0] == "error":
                raise WorkerError(f"benchmark client failed to start:\n{msg[1]}")
            self.server_pid = msg[2]

    def start(self, warmup_s: float, window_s: float) -> int:
        self.window_ns = int(window_s * 1e9)
        self.t0 = now_ns() + 20_000_000
        self.w0 = self.t0 + int(warmup_s * 1e9)
        for c in self.conns:
            c.send(("go", self.t0, int(warmup_s * 1e9), self.window_ns))
        return self.t0

    def _take(self, w: int, msg) -> None:
        kind = msg[0]
        if kind == "error":
            raise WorkerError(f"benchmark client {w} failed:\n{msg[1]}")
        _, boundary, recs, errors, cpu, at = msg
        if len(recs):
            self.pool = np.concatenate([self.pool, recs])
        self.errors_total.update(errors)
        self.cpu[w].append((boundary, cpu, at))
        if kind == "final":
            self.final[w] = True
            self.reported[w] = 1 << 60
        else:
            self.reported[w] = max(self.reported[w], boundary)

    def window(self, k: int, timeout_s: float):
        """Records that completed in window k (1-based: [w0 + (k-1) P, w0 + k P)),
        once every worker has passed its end; None on timeout. k = 0: the warm-up's
        last stretch, returned once every worker has reported the end of the warm-up."""
        deadline = time.monotonic() + timeout_s
        while min(self.reported) < k:
            waiting = [c for w, c in enumerate(self.conns) if self.reported[w] < k]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for c in mp_wait(waiting, left):
                w = self.conns.index(c)
                try:
                    msg = c.recv()
                except EOFError:
                    raise WorkerError(f"benchmark client {w} exited unexpectedly") from None
                self._take(w, msg)
        lo = self.w0 + (k - 1) * self.window_ns
        return S.in_window(self.pool, lo, lo + self.window_ns)

    def cpu_seconds(self, k0: int, k1: int) -> float | None:
        """CPU time all workers used between boundaries k0 and k1 (as they reported
        them: each worker's CPU time when it sent its first message at or after the
        boundary; window k lies between boundaries k - 1 and k)."""
        total = 0.0
        for marks in self.cpu:
            a = next((c for b, c, _ in marks if b >= k0), None)
            b = next((c for bb, c, _ in marks if bb >= k1), None)
            if a is None or b is None:
                return None
            total += b - a
        return total

    def stop(self, timeout_s: float = 60.0) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while not all(self.final) and time.monotonic() < deadline:
            pending = [c for w, c in enumerate(self.conns) if not self.final[w]]
            for c in mp_wait(pending, max(0.0, deadline - time.monotonic())):
                w = self.conns.index(c)
                try:
                    self._take(w, c.recv())
                except EOFError:
                    self.final[w] = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for c in self.conns:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.closed:
            self.stop(10)
