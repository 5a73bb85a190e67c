#!/usr/bin/env python3
"""The GPU figures of scripts/gpu_check.sh, in one short run on a GPU machine.

  1 copies     host -> device bandwidth of 64 MiB, median of --repeats copies each:
               pageable numpy memory, pinned memory (cupy's cudaMallocHost: the
               reference "cudaMemcpy pinned"), and a shared-memory segment like a
               client arena (a /dev/shm file mapped by mmap) registered with
               cudaHostRegister: what pinning the callers' arenas would give, as a
               ratio of the pinned reference (issue 15's target: >= 80 %).
  2 round trip a TorchScript model (x * 2 + 1, FP32) served on a KIND_GPU instance,
               p50 of --requests each (a quarter for 4 MiB), interleaved in blocks:
               4 KiB from numpy against the same module in torch directly (numpy ->
               device -> compute -> host); a 4 MiB torch tensor on the GPU by CUDA IPC,
               output into the caller's tensor, against the same compute in torch and a
               bare 4 MiB device copy; 4 MiB from numpy through the page-locked arena
               against torch directly from numpy.

Needs cupy and torch with CUDA; prints a line per figure (and skips a part, saying
what is missing). Nothing is asserted.

    python bench/gpu_check.py [--repeats 20] [--requests 2000]
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

MIB = 1 << 20


def copies(repeats: int) -> None:
    try:
        import cupy
        import cupyx
    except ImportError as e:
        print(f"copies: skipped (cupy: {e})")
        return
    n = 64 * MIB
    dev = cupy.empty(n, dtype=np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)

    def gbps(host) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dev.set(host, stream=stream)
            stream.synchronize()
            times.append(time.perf_counter() - start)
        return n / statistics.median(times) / 1e9

    pageable = np.ones(n, dtype=np.uint8)
    pinned = cupyx.empty_pinned(n, dtype=np.uint8)
    pinned[:] = 1
    fd = os.open(f"/dev/shm/shmserve-gpu-check-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, n)
        region = mmap.mmap(fd, n)
        arena = np.frombuffer(region, dtype=np.uint8)
        arena[:] = 1
        cupy.cuda.runtime.hostRegister(arena.ctypes.data, n, 0)
        try:
            figures = {"pageable": gbps(pageable), "pinned": gbps(pinned),
                       "registered arena": gbps(arena)}
        finally:
            cupy.cuda.runtime.hostUnregister(arena.ctypes.data)
        del arena
        region.close()
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/shmserve-gpu-check-{os.getpid()}")
    for name, value in figures.items():
        print(f"copies: H2D 64 MiB from {name}: {value:.1f} GB/s "
              f"({100 * value / figures['pinned']:.0f} % of pinned)")


def interleaved(calls: dict, requests: int) -> dict:
    """p50 (us) of each call, taken in turns of blocks (drift weighs on all alike)."""
    samples = {name: [] for name in calls}
    for _ in range(10):
        for name, call in calls.items():
            for _ in range(max(requests // 10, 1)):
                start = time.perf_counter_ns()
                call()
                samples[name].append(time.perf_counter_ns() - start)
    return {k: statistics.median(v) / 1000 for k, v in samples.items()}


STAGES = ("write", "to batcher", "batching", "to worker", "inputs+model", "outputs+answer",
          "to caller")


def stages(client, cases: dict, requests: int) -> None:
    """Median of each stage of the requests' own timestamps (protocol Timestamp), us."""
    for name, (inputs, outputs) in cases.items():
        deltas = []
        for _ in range(requests):
            t = client.infer("affine", inputs, outputs=outputs).timestamps_ns
            deltas.append([(t[i + 1] - t[i]) / 1000 for i in range(7)])
        med = np.median(np.array(deltas), axis=0)
        print(f"stages: {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in zip(STAGES, med)))


def round_trip(requests: int) -> None:
    try:
        import torch
    except ImportError as e:
        print(f"round trip: skipped (torch: {e})")
        return
    if not torch.cuda.is_available():
        print("round trip: skipped (torch sees no CUDA device)")
        return
    from shmserve_bench.harness import ServerProcess

    class Affine(torch.nn.Module):
        def forward(self, x):
            return x * 2.0 + 1.0

    work = Path(tempfile.mkdtemp(prefix="shmserve-gpu-check-"))
    model = work / "repo" / "affine"
    (model / "1").mkdir(parents=True)
    torch.jit.script(Affine()).save(str(model / "1" / "model.pt"))
    (model / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'instance_group [ { kind: KIND_GPU count: 1 } ]\n')
    server = ServerProcess(work / "repo", log_path=work / "server.log", name_prefix="gpu-")
    bare = torch.jit.script(Affine()).cuda()
    x = np.random.default_rng(0).standard_normal((1, 1024)).astype(np.float32)

    def direct():
        with torch.inference_mode():
            return bare(torch.from_numpy(x).cuda()).cpu().numpy()

    try:
        server.start()
        with server.client(arena_bytes=64 << 20) as client:
            served = lambda: client.infer("affine", [x])["OUTPUT__0"]  # noqa: E731
            np.testing.assert_allclose(served(), direct(), rtol=1e-6)
            p50 = interleaved({"served": served, "direct": direct}, requests)
            print(f"round trip: 4 KiB TorchScript on the GPU, p50 served {p50['served']:.1f} us, "
                  f"torch directly {p50['direct']:.1f} us, ratio {p50['served'] / p50['direct']:.2f}")
            # 4 MiB: a device tensor through CUDA IPC (in place, output into the caller's
            # tensor) against the same compute in torch and a bare device copy; and the
            # same bytes from host memory through the page-locked arena.
            big = np.random.default_rng(1).standard_normal((1, 1 << 20)).astype(np.float32)
            dx = torch.from_numpy(big).cuda()
            dout = torch.empty_like(dx)

            def device_served():
                client.infer("affine", {"x": dx}, outputs={"OUTPUT__0": dout})

            def device_direct():
                with torch.inference_mode():
                    torch.mul(dx, 2.0, out=dout).add_(1.0)
                torch.cuda.synchronize()

            def device_copy():
                dout.copy_(dx)
                torch.cuda.synchronize()

            def host_served():
                return client.infer("affine", [big])["OUTPUT__0"]

            def host_direct():
                with torch.inference_mode():
                    return bare(torch.from_numpy(big).cuda()).cpu().numpy()

            device_served()
            assert torch.equal(dout, dx * 2 + 1)
            np.testing.assert_allclose(host_served(), host_direct(), rtol=1e-6)
            p50 = interleaved({"ipc": device_served, "torch": device_direct, "copy": device_copy,
                               "host": host_served, "host_torch": host_direct}, requests // 4)
            print(f"round trip: 4 MiB device tensor by CUDA IPC, p50 served {p50['ipc']:.1f} us, "
                  f"torch directly {p50['torch']:.1f} us (ratio {p50['ipc'] / p50['torch']:.2f}), "
                  f"bare device copy {p50['copy']:.1f} us")
            from shmserve.gpu import ipc  # the caller's side of a device request, alone
            events = ipc.SlotEvents()
            p50_parts = interleaved({"describe": lambda: ipc.DeviceSource(dx, "x"),
                                     "event": lambda: events.record(0, [ipc.DeviceSource(dx, "x")])},
                                    requests)
            events.close()
            print(f"round trip: of which the caller describes a device tensor in "
                  f"{p50_parts['describe']:.1f} us, and records its event in "
                  f"{p50_parts['event'] - p50_parts['describe']:.1f} us")
            stages(client, {"4 KiB host": ([x], None), "4 MiB IPC": ({"x": dx}, {"OUTPUT__0": dout}),
                            "4 MiB host": ([big], None)}, requests // 4)
            wrap = ipc._CudaArray(dx.data_ptr(), tuple(dx.shape), np.dtype(np.float32))
            p50_parts = interleaved({"as_tensor": lambda: torch.as_tensor(wrap, device="cuda"),
                                     "sync": lambda: torch.cuda.current_stream().synchronize()},
                                    requests)
            print(f"stages: a device pointer as a torch tensor {p50_parts['as_tensor']:.1f} us, "
                  f"an idle stream's synchronize {p50_parts['sync']:.1f} us")
            print(f"round trip: 4 MiB host array via the page-locked arena, p50 served "
                  f"{p50['host']:.1f} us, torch directly from numpy {p50['host_torch']:.1f} us "
                  f"(ratio {p50['host'] / p50['host_torch']:.2f})")
    except Exception as e:  # a figure missing says why; the other figures still print
        print(f"round trip: failed: {type(e).__name__}: {e}\n--- server log ---\n"
              f"{(work / 'server.log').read_text() if (work / 'server.log').exists() else ''}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    copies(args.repeats)
    round_trip(args.requests)


if __name__ == "__main__":
    main()
