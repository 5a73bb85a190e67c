#!/usr/bin/env python
"""Soak runner (issue 5): mixed load, killed workers and killed clients, then checks.

    python scripts/soak.py --duration 60            # brief
    python scripts/soak.py                          # 10 minutes

Starts a server on the bundled model_repository (or --model-repository), runs
--clients client processes for --duration seconds (identity of various sizes, simple,
mlp; blocking infer and submit), SIGKILLs a random worker process of the server every
--kill-worker-every seconds (never more than 4 kills of one worker lineage in 60 s, so
that no model is retired for crash-looping) and a random client process every
--kill-client-every seconds (restarting it). Each client incarnation logs every
request id it sends and every answer (checked bit-exact, allclose for mlp) to its own
file. At the end it checks:

- every request of a client that was not killed was answered exactly once, by a
  correct result or an error status; a wrong result, a timeout (per request
  --request-timeout) or a duplicate answer is a violation;
- after all clients left, only the control and server segments remain in /dev/shm;
- the RSS of the coordinator and the batcher grew by less than --rss-limit-mb between
  the sample after warm-up and the end (worker lineages are reported too);
- every model is still READY; after SIGTERM the server exits 0, leaves no segment and
  no process.

Prints a summary table; exits 1 on any violation. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from shmserve_bench.harness import ServerProcess, poll_until  # noqa: E402
from shmserve_bench.proctree import children_of  # noqa: E402


# ---------------------------------------------------------------- server processes

def role_of(pid: int) -> str:
    """"batcher", "worker", ...: the last part of the `python -m shmserve.<...>` module."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    for part in cmd:
        if part.startswith(b"shmserve."):
            return part.decode().rsplit(".", 1)[-1]
    return "?"


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def prepare_repo(src: Path, tmp: Path) -> Path:
    """The repository as given, or a copy with mlp/1/model.onnx generated if missing."""
    onnx = src / "mlp" / "1" / "model.onnx"
    if not (src / "mlp").is_dir() or onnx.exists():
        return src
    dst = tmp / "repo"
    shutil.copytree(src, dst)
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import make_models
    make_models.write_mlp(dst / "mlp" / "1" / "model.onnx")
    return dst


# ---------------------------------------------------------------- client processes

def client_main(index: int, incarnation: int, name: str, socket_path: str, log_path: str,
                stop_at: float, seed: int, timeout: float, onnx_path: str | None) -> None:
    """One client process: mixed requests until stop_at, each logged before it is sent
    ("S id") and when answered ("A id ok|err:<code>:<type>|wrong:<why>|timeout")."""
    import numpy as np

    import shmserve
    from shmserve import errors

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    rng = np.random.default_rng(seed)
    ref = None
    if onnx_path:
        try:
            import onnxruntime as ort
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            sess = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
            ref = lambda x: sess.run(None, {sess.get_inputs()[0].name: x})[0]  # noqa: E731
        except Exception:
            ref = None
    counter = [0]

    def new_id() -> str:
        counter[0] += 1
        return f"{index}.{incarnation}.{counter[0]}"

    def make(model: str):
        if model == "identity":
            n = int(rng.choice([1, 16, 1000, 4096, 65536, 262144]))
            rows = int(rng.integers(1, 4))
            x = rng.standard_normal((rows, n)).astype(np.float32)
            return {"INPUT0": x}, (lambda out: np.array_equal(out["OUTPUT0"], x))
        if model == "simple":
            rows = int(rng.integers(1, 9))
            a = rng.integers(-10**6, 10**6, (rows, 16), dtype=np.int32)
            b = rng.integers(-10**6, 10**6, (rows, 16), dtype=np.int32)
            return {"INPUT0": a, "INPUT1": b}, (lambda out: np.array_equal(out["OUTPUT0"], a + b)
                                                and np.array_equal(out["OUTPUT1"], a - b))
        rows = int(rng.integers(1, 9))
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        want = ref(x) if ref else None
        return {"INPUT0": x}, (lambda out: out["OUTPUT0"].shape == (rows, 16) and (
            want is None or np.allclose(out["OUTPUT0"], want, rtol=1e-4, atol=1e-5)))

    def verdict(check, fn) -> str:
        try:
            out = fn()
        except errors.ServerTimeoutError:
            return "timeout"
        except errors.ShmServeError as e:
            return f"err:{getattr(e, 'code', '?')}:{type(e).__name__}"
        except TimeoutError:
            return "timeout"
        except Exception as e:  # anything else is a client-side failure worth seeing
            return f"wrong:{type(e).__name__}:{str(e)[:80]}"
        try:
            ok = check(out)
        finally:
            out.release()
        return "ok" if ok else "wrong:result"

    models = ["identity", "simple", "mlp"]
    try:
        client = shmserve.Client(name, socket_path_=socket_path, arena_bytes=32 << 20)
    except Exception as e:
        log(f"X connect {type(e).__name__}: {e}")
        return
    with client:
        while time.time() < stop_at:
            if rng.random() < 0.5:  # blocking infer
                model = models[int(rng.integers(len(models)))]
                inputs, check = make(model)
                rid = new_id()
                log(f"S {rid} {model}")
                log(f"A {rid} {verdict(check, lambda: client.infer(model, inputs, timeout=timeout))}")
            else:  # several submits in flight, then their results
                pending = []
                for _ in range(int(rng.integers(1, 6))):
                    model = models[int(rng.integers(len(models)))]
                    inputs, check = make(model)
                    rid = new_id()
                    log(f"S {rid} {model}")
                    try:
                        fut = client.submit(model, inputs)
                    except Exception as e:
                        log(f"A {rid} {verdict(check, lambda e=e: (_ for _ in ()).throw(e))}")
                        continue
                    pending.append((rid, check, fut))
                for rid, check, fut in pending:
                    log(f"A {rid} {verdict(check, lambda f=fut: f.result(timeout=timeout))}")
    log("X done")
    os.close(fd)


# ---------------------------------------------------------------- the soak

class Soak:
    def __init__(self, args):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="shms-soak-", dir="/tmp"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.rng = random.Random(args.seed)
        self.violations: list[str] = []
        self.kills = collections.Counter()
        self.kill_times: dict[str, list[float]] = collections.defaultdict(list)
        self.labels: dict[int, str] = {}  # worker pid -> lineage label
        self.server: ServerProcess | None = None

    # -- server -------------------------------------------------------------------
    def start_server(self) -> None:
        src = Path(self.args.model_repository).resolve()
        self.repo = prepare_repo(src, self.tmp)
        onnx = self.repo / "mlp" / "1" / "model.onnx"
        self.onnx = str(onnx) if onnx.exists() else None
        self.server = ServerProcess(self.repo, log_path=self.tmp / "server.log",
                                    name_prefix="soak", args=self.args.server_arg)
        try:
            self.server.start(timeout=120)
        except RuntimeError as e:
            raise SystemExit(str(e)[-3000:]) from None
        self.name, self.socket_path = self.server.name, self.server.socket_path
        for i, pid in enumerate(self.workers()):
            self.labels[pid] = f"worker{i}"

    def client(self):
        return self.server.client(arena_bytes=8 << 20)

    def server_pids(self) -> dict[str, int]:
        """role/lineage label -> pid of every live server process."""
        out = {"coordinator": self.server.pid}
        for pid in children_of(self.server.pid):
            role = role_of(pid)
            out[self.labels.get(pid, f"{role}:{pid}") if role == "worker" else role] = pid
        return out

    def workers(self) -> list[int]:
        return [p for p in children_of(self.server.pid) if role_of(p) == "worker"]

    def warm_up(self) -> None:
        import numpy as np
        with self.client() as c:
            for _ in range(20):
                c.infer("identity", {"INPUT0": np.ones((1, 1000), np.float32)}, timeout=30)
                c.infer("simple", {"INPUT0": np.ones((1, 16), np.int32),
                                   "INPUT1": np.ones((1, 16), np.int32)}, timeout=30)
                if self.onnx:
                    c.infer("mlp", {"INPUT0": np.ones((4, 256), np.float32)}, timeout=30)
            self.models_at_start = {m["name"]: m["state"] for m in c.models()}

    def sample_rss(self) -> dict[str, int]:
        return {label: rss_kib(pid) or 0 for label, pid in self.server_pids().items()}

    def kill_a_worker(self, now: float) -> None:
        eligible = []
        for pid in self.workers():
            label = self.labels.get(pid)
            if label is None:
                continue
            recent = [t for t in self.kill_times[label] if now - t < 60]
            self.kill_times[label] = recent
            if len(recent) < 4:
                eligible.append(pid)
        if not eligible:
            return
        pid = self.rng.choice(eligible)
        label = self.labels.pop(pid)
        before = set(self.workers())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kill_times[label].append(now)
        self.kills["worker"] += 1
        self.pending_restart = (label, before - {pid}, time.monotonic() + 30)

    def adopt_restarted(self) -> None:
        """Gives a restarted worker the lineage label of the one it replaces."""
        if not getattr(self, "pending_restart", None):
            return
        label, others, deadline = self.pending_restart
        new = [p for p in self.workers() if p not in others and p not in self.labels]
        if new:
            self.labels[new[0]] = label
            self.pending_restart = None
        elif time.monotonic() > deadline:
            self.violations.append(f"{label} was not restarted within 30 s of its kill")
            self.pending_restart = None

    # -- clients ------------------------------------------------------------------
    def spawn_client(self, index: int, incarnation: int, stop_at: float):
        path = self.logs / f"client{index}.{incarnation}.log"
        p = self.ctx.Process(target=client_main, args=(
            index, incarnation, self.name, str(self.socket_path), str(path), stop_at,
            self.args.seed * 1000 + index * 100 + incarnation, self.args.request_timeout,
            self.onnx), daemon=True)
        p.start()
        return p, path

    # -- run ----------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        self.ctx = multiprocessing.get_context("spawn")
        t0 = time.monotonic()
        self.start_server()
        self.warm_up()
        rss_start = self.sample_rss()
        print(f"server up in {time.monotonic() - t0:.1f} s (pid {self.server.pid}); soaking {a.duration:.0f} s with {a.clients} clients; logs in {self.tmp}",
              flush=True)
        stop_at = time.time() + a.duration
        clients = {}
        incarnations = collections.Counter()
        self.killed_logs: set[str] = set()
        self.all_logs: list[Path] = []
        for i in range(a.clients):
            clients[i] = self.spawn_client(i, 0, stop_at)
            self.all_logs.append(clients[i][1])
        next_worker_kill = time.monotonic() + a.kill_worker_every
        next_client_kill = time.monotonic() + a.kill_client_every
        rss_peak = dict(rss_start)
        while time.time() < stop_at:
            now = time.monotonic()
            self.adopt_restarted()
            if a.kill_worker_every > 0 and now >= next_worker_kill and not getattr(
                    self, "pending_restart", None):
                self.kill_a_worker(now)
                next_worker_kill = now + a.kill_worker_every
            if a.kill_client_every > 0 and now >= next_client_kill and time.time() < stop_at - 2:
                i = self.rng.randrange(a.clients)
                p, path = clients[i]
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                    p.join()
                    self.kills["client"] += 1
                    self.killed_logs.add(str(path))
                incarnations[i] += 1
                clients[i] = self.spawn_client(i, incarnations[i], stop_at)
                self.all_logs.append(clients[i][1])
                next_client_kill = now + a.kill_client_every
            if not self.server.running():
                self.violations.append(f"coordinator exited ({self.server.returncode}) during the soak")
                break
            for label, kib in self.sample_rss().items():
                rss_peak[label] = max(rss_peak.get(label, 0), kib)
            time.sleep(0.2)
        # let the clients finish their last requests (each waits at most request_timeout)
        for i, (p, path) in clients.items():
            p.join(a.request_timeout * 6 + 30)
            if p.is_alive():
                self.violations.append(f"client process {i} still running {a.request_timeout * 6 + 30:.0f} s "
                                       "after the end: hung")
                p.kill()
                p.join()
                self.killed_logs.add(str(path))
        self.adopt_restarted()
        return self.finish(rss_start, rss_peak, t0)

    # -- checks -------------------------------------------------------------------
    def check_logs(self) -> dict:
        totals = collections.Counter()
        per_model = collections.defaultdict(collections.Counter)
        for path in self.all_logs:
            killed = str(path) in self.killed_logs
            sent, answered = {}, collections.Counter()
            results = {}
            done = False
            try:
                lines = path.read_text().splitlines()
            except OSError:
                lines = []
            for line in lines:
                parts = line.split(" ", 2)
                if parts[0] == "S":
                    if parts[1] in sent:
                        self.violations.append(f"{path.name}: id {parts[1]} sent twice")
                    sent[parts[1]] = parts[2]
                elif parts[0] == "A":
                    answered[parts[1]] += 1
                    results[parts[1]] = parts[2]
                elif parts[0] == "X":
                    done = parts[1] == "done"
                    if parts[1] != "done":
                        self.violations.append(f"{path.name}: {line}")
            if not killed and not done:
                self.violations.append(f"{path.name}: client did not finish its loop")
            totals["sent"] += len(sent)
            for rid, model in sent.items():
                n = answered.get(rid, 0)
                if n == 0:
                    if killed:
                        totals["in flight at client kill"] += 1
                    else:
                        totals["unanswered"] += 1
                        self.violations.append(f"{path.name}: request {rid} ({model}) never answered")
                    continue
                if n > 1:
                    self.violations.append(f"{path.name}: request {rid} answered {n} times")
                r = results[rid]
                kind = r.split(":")[0]
                if kind == "err":
                    kind = "error " + r.split(":", 2)[2]
                totals[kind] += 1
                per_model[model][kind] += 1
                if r == "timeout":
                    self.violations.append(f"{path.name}: request {rid} ({model}) timed out")
                elif r.startswith("wrong"):
                    self.violations.append(f"{path.name}: request {rid} ({model}) {r}")
            for rid in answered:
                if rid not in sent:
                    self.violations.append(f"{path.name}: answer for unknown id {rid}")
        return {"totals": totals, "per_model": per_model}

    def finish(self, rss_start, rss_peak, t0) -> int:
        a = self.args
        counts = self.check_logs()
        # no client left: the coordinator holds no arena, and nothing of the server's
        # is in /dev/shm (every segment is a memfd)
        poll_until(lambda: not self.server.arenas(), 10.0)
        left = self.server.segments()
        if left:
            self.violations.append(f"/dev/shm after all clients left: {left} (expected nothing)")
        arenas = self.server.arenas()
        if arenas:
            self.violations.append(f"arenas still open in the coordinator 10 s after the last "
                                   f"client left: {arenas}")
        rss_end = self.sample_rss()
        with self.client() as c:
            states = {m["name"]: m["state"] for m in c.models()}
            stats = {r["name"]: r for r in c.statistics()}
        for name, st in states.items():
            if st != self.models_at_start.get(name):
                self.violations.append(f"model {name} is {st} at the end "
                                       f"(was {self.models_at_start.get(name)})")
        rss_rows = []
        for label in sorted(set(rss_start) | set(rss_end)):
            s, e = rss_start.get(label), rss_end.get(label)
            growth = (e - s) if (s and e) else None
            rss_rows.append((label, s, rss_peak.get(label), e, growth))
            if label in ("coordinator", "batcher") and growth is not None \
                    and growth > a.rss_limit_mb * 1024:
                self.violations.append(f"{label} RSS grew {growth / 1024:.1f} MiB "
                                       f"(limit {a.rss_limit_mb} MiB)")
        # shutdown: SIGTERM, then nothing may be left (the harness reports, then removes)
        self.violations += [f"shutdown: {p}" for p in self.server.teardown(term_timeout=30)]
        code = self.server.returncode
        if code != 0:
            self.violations.append(f"server exited {code} on SIGTERM")

        # summary
        tot = counts["totals"]
        wall = time.monotonic() - t0
        print(f"\n== soak summary ({a.duration:.0f} s of load, {wall:.0f} s in all, "
              f"{a.clients} clients, seed {a.seed}) ==")
        print(f"kills: {self.kills['worker']} workers, {self.kills['client']} clients; "
              f"client incarnations: {len(self.all_logs)}")
        print(f"{'requests':<34}{'count':>10}")
        for k in ["sent", "ok"] + sorted(k for k in tot if k.startswith("error")) + \
                ["in flight at client kill", "timeout", "wrong", "unanswered"]:
            print(f"  {k:<32}{tot.get(k, 0):>10}")
        print(f"  {'throughput (answered/s)':<32}{(tot['sent'] - tot['in flight at client kill']) / a.duration:>10.0f}")
        print(f"{'per model':<12}" + "".join(f"{k:>14}" for k in ("ok", "errors", "server ok", "server fail")))
        for m in sorted(counts["per_model"]):
            pm = counts["per_model"][m]
            errs = sum(v for k, v in pm.items() if k.startswith("error"))
            s = stats.get(m, {})
            served = s.get("inference_stats", {})
            print(f"  {m:<10}{pm['ok']:>14}{errs:>14}{served.get('success', {}).get('count', 0):>14}"
                  f"{served.get('fail', {}).get('count', 0):>14}")
        print(f"{'server RSS (MiB)':<22}{'start':>10}{'peak':>10}{'end':>10}{'growth':>10}")
        for label, s, p, e, g in rss_rows:
            f = lambda v: f"{v / 1024:.1f}" if v else "-"  # noqa: E731
            print(f"  {label:<20}{f(s):>10}{f(p):>10}{f(e):>10}"
                  f"{(f'{g / 1024:+.1f}' if g is not None else '-'):>10}")
        print(f"/dev/shm with no client: {'ok' if not left else left}; at shutdown: "
              f"{'LEFT' if self.server.leftover else 'clean'}; exit code {code}")
        if self.violations:
            print(f"\nVIOLATIONS ({len(self.violations)}):")
            for v in self.violations[:50]:
                print("  " + v)
            if len(self.violations) > 50:
                print(f"  ... and {len(self.violations) - 50} more")
            print(f"logs kept in {self.tmp}")
            return 1
        print("\nno violations")
        if not a.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return 0

    def cleanup(self) -> None:
        """Whatever happened: the server stopped, nothing of it left behind."""
        if self.server is not None and self.server.proc is not None:
            for problem in self.server.teardown():
                print(f"cleanup: {problem}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    ap.add_argument("--kill-worker-every", type=float, default=3.0,
                    help="SIGKILL a random worker this often, s (0: never)")
    ap.add_argument("--kill-client-every", type=float, default=5.0,
                    help="SIGKILL and restart a random client this often, s (0: never)")
    ap.add_argument("--request-timeout", type=float, default=15.0,
                    help="per-request timeout in the clients, s (a timeout is a violation)")
    ap.add_argument("--rss-limit-mb", type=float, default=32.0,
                    help="allowed RSS growth of the coordinator and the batcher, MiB")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for `shmserve serve` (repeatable)")
    args = ap.parse_args(argv)
    soak = Soak(args)
    try:
        return soak.run()
    finally:
        soak.cleanup()


if __name__ == "__main__":
    sys.exit(main())
