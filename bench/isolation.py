#!/usr/bin/env python3
"""What one hostile or greedy caller does to a polite one (issue 14).

One private server serves the bundled identity model. A polite caller (this process)
runs a closed loop of identity 4 KiB requests, --seconds per phase, and checks every
answer. Phases alternate: undisturbed, then one attacker process running one attack
for the whole phase, then undisturbed again, and so on; each attack's figures are
compared with the mean of the undisturbed phases around it (the machine's drift
weighs on both). Attacks, protocol version 5 (docs/reliability.md, issue 14; the
control block is read-only to clients, so what an attacker can write is its own arena,
its own submission ring included, and the bell page): the rounds of
bench/shmserve_bench/hostile.py, ATTACKS, run in a loop:

  own-claim           claims its own ring's head and never publishes, again after
                      each skip (the batcher skips a stalled claim after 20 ms)
  forged-claim        the same, the claim word naming the polite caller
  enqueue-jump        moves its arena's enqueue_pos 10^9 ahead
  ring-header         rewrites its arena header's ring_offset and ring_capacity
  garbage-cells       random words in every cell of its ring
  foreign-entries     publishes entries naming the polite caller's client id and slots
  bell-moved-back     stores bell.doorbell back to one value, in a tight loop
  doorbell-loop       moves bell.doorbell and FUTEX_WAKEs it, in a loop
  wake-stealer        4 threads FUTEX_WAIT on bell.doorbell, so that a push wakes one
                      of them rather than the batcher
  flood-64            honest requests from 64 threads (two leases of 32 slots) as fast
                      as they are answered: fair share between callers

Reported per attack: the polite caller's p50 and p99 and their ratio to the
undisturbed run, its requests done, any that failed, and what became of the
attacker's own request sent right after its attack (answered, how late). Issue 14's
bar: p99 within 2x of undisturbed, nothing failed. Nothing is asserted.

--model paced serves, instead of identity, a python model that sleeps --pace-ms per
batch of at most 4 rows: its queue, not the CPU, is what a flood fills, so the
flood-64 row shows what the queue's order (fair share between callers) does, apart
from the machine's load.

    python bench/isolation.py                       # about 2.5 minutes
    python bench/isolation.py --seconds 3 --only forged-claim flood-64
    python bench/isolation.py --only flood-64 --max-queued-per-client 8   # the server's limit
    python bench/isolation.py --only flood-64 --model paced
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from shmserve_bench import hostile  # noqa: E402
from shmserve_bench.harness import ServerProcess  # noqa: E402
from shmserve.protocol import RingResult, Status  # noqa: E402

# A model whose time is a sleep per batch (--model paced): the queue is the bottleneck.
PACED_CONFIG = """name: "paced"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { }
parameters { key: "pace_ms" value { string_value: "%g" } }
"""
PACED_CODE = """import json, time

class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.pace = float(params["pace_ms"]["string_value"]) / 1000

    def execute(self, inputs):
        time.sleep(self.pace)
        return {"OUTPUT0": inputs["INPUT0"]}
"""

ATTACKS = [*hostile.ATTACKS, "flood-64"]


def _flood(socket_path: str, name: str, model: str, stop) -> None:
    import shmserve

    x = np.ones((1, 1024), np.float32)

    def loop(client):
        while not stop.is_set():
            try:
                client.infer(model, [x]).release()
            except Exception:  # its own requests may fail (BUSY): it goes on
                time.sleep(0.001)

    clients = [shmserve.Client(name, socket_path_=socket_path, arena_bytes=8 << 20)
               for _ in range(2)]
    threads = [threading.Thread(target=loop, args=(c,), daemon=True)
               for c in clients for _ in range(32)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(5)


def attacker(attack: str, socket_path: str, name: str, model: str, victim_id: int, ready,
             stop, conn) -> None:
    """Runs one attack until stop is set (a spawned process: its own GIL and lease);
    then, but for the flood, sends back what became of its own request (hostile.attacker)."""
    if attack == "flood-64":
        ready.set()
        _flood(socket_path, name, model, stop)
        return
    hostile.attacker(attack, socket_path, victim_id, ready, stop, conn, model=model)


def polite_phase(client, model: str, seconds: float) -> dict:
    x = np.arange(1024, dtype=np.float32).reshape(1, 1024)
    lat, failed = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter_ns()
        try:
            r = client.infer(model, [x], timeout=10)
            ok = np.array_equal(r["OUTPUT0"], x)
            r.release()
            if not ok:
                failed.append("wrong answer")
                continue
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
            continue
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    return {"n": len(lat), "failed": failed,
            "p50": float(np.percentile(lat, 50)) if lat else float("nan"),
            "p99": float(np.percentile(lat, 99)) if lat else float("nan")}


def own_text(own) -> str:
    """hostile.attacker's report of the attacker's own request, in a few words."""
    if own is None:
        return "-"
    status, error, rc, took, _ = own
    said = "unanswered" if status is None else Status(status).name
    return f"{said} in {took * 1e3:.1f} ms (push {RingResult(rc).name})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="each phase")
    ap.add_argument("--only", nargs="*", choices=ATTACKS)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-queued-per-client", type=int, default=0,
                    help="the server's limit (default 0: none; fair share only)")
    ap.add_argument("--model", choices=["identity", "paced"], default="identity")
    ap.add_argument("--pace-ms", type=float, default=2.0, help="--model paced: sleep per batch")
    args = ap.parse_args()
    attacks = args.only or ATTACKS
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shmserve-isolation-") as tmp:
        repo = Path(tmp) / "repo"
        if args.model == "paced":
            (repo / "paced" / "1").mkdir(parents=True)
            (repo / "paced" / "config.pbtxt").write_text(PACED_CONFIG % args.pace_ms)
            (repo / "paced" / "1" / "model.py").write_text(PACED_CODE)
        else:
            shutil.copytree(ROOT / "model_repository" / "identity", repo / "identity")
        limit = args.max_queued_per_client
        server = ServerProcess(repo, log_path=Path(tmp) / "server.log",
                               args=["--max-queued-per-client", str(limit)] if limit else [])
        rows = []
        try:
            server.start()
            polite = server.client(arena_bytes=1 << 20)
            victim_id = polite.engine.client_id
            polite_phase(polite, args.model, 1.0)  # warm
            before = polite_phase(polite, args.model, args.seconds)
            for attack in attacks:
                print(f"# {attack} ...", file=sys.stderr, flush=True)
                ready, stop = ctx.Event(), ctx.Event()
                mine, theirs = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=attacker, args=(attack, str(server.socket_path),
                                                          server.name, args.model, victim_id,
                                                          ready, stop, theirs))
                proc.start()
                own = None
                try:
                    ready.wait(30)
                    hit = polite_phase(polite, args.model, args.seconds)
                finally:
                    stop.set()
                    if attack != "flood-64" and mine.poll(30):
                        own = mine.recv()
                    proc.join(20)
                    if proc.is_alive():
                        proc.kill()
                        proc.join()
                time.sleep(1.2)  # the batcher's defences (1 s) and quick sweeps end
                after = polite_phase(polite, args.model, args.seconds)
                base = {k: (before[k] + after[k]) / 2 for k in ("p50", "p99")}
                rows.append({"attack": attack, "undisturbed": base, "attacked": hit,
                             "p50_ratio": hit["p50"] / base["p50"],
                             "p99_ratio": hit["p99"] / base["p99"], "own": own})
                before = after
        finally:
            problems = server.teardown()
            if problems:
                print("teardown: " + "; ".join(problems), file=sys.stderr)
    load = open("/proc/loadavg").read().split()[0]
    model = "identity" if args.model == "identity" else f"paced ({args.pace_ms:g} ms a batch of <= 4)"
    print(f"\npolite caller: {model} 4 KiB closed loop, {args.seconds:g} s a phase, "
          f"load average {load}, --max-queued-per-client {args.max_queued_per_client}\n")
    print("| attack | undisturbed p50 / p99 us | attacked p50 / p99 us | p50 / p99 ratio | "
          "requests | failed | attacker's own request |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        u, a = r["undisturbed"], r["attacked"]
        print(f"| {r['attack']} | {u['p50']:.0f} / {u['p99']:.0f} | {a['p50']:.0f} / {a['p99']:.0f} "
              f"| {r['p50_ratio']:.1f}x / {r['p99_ratio']:.1f}x | {a['n']} | {len(a['failed'])} "
              f"| {own_text(r['own'])} |")
    for r in rows:
        if r["attacked"]["failed"]:
            print(f"{r['attack']}: first failure: {r['attacked']['failed'][0]}")
    if args.json:
        args.json.write_text(json.dumps({"load": load, "rows": rows, "model": args.model,
                                         "pace_ms": args.pace_ms,
                                         "max_queued_per_client": args.max_queued_per_client},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
