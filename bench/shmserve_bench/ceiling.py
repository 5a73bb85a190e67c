"""The ceiling a served model is compared with: bare onnxruntime, one session, timed
(median of runs) at the batch sizes the server formed."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def ort_ceiling(model_path: Path, histogram: dict, threads: int = 1,
                budget_s: float = 3.0) -> dict:
    """Bare onnxruntime (`threads` intra-op threads, sequential) on the batch sizes of
    `histogram` {batch size: batches}, first input fed random FP32 rows of the model's
    width: inferences/s if every batch ran as fast as the bare session runs it, the
    median time of each batch size, and the mean batch."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    first = sess.get_inputs()[0]
    width = int(first.shape[-1])
    rng = np.random.default_rng(0)
    times = {}
    for b in sorted(histogram):
        x = rng.standard_normal((int(b), width)).astype(np.float32)
        for _ in range(3):
            sess.run(None, {first.name: x})
        runs, t_end = [], time.perf_counter() + budget_s / max(1, len(histogram))
        while time.perf_counter() < t_end or len(runs) < 5:
            t0 = time.perf_counter_ns()
            sess.run(None, {first.name: x})
            runs.append(time.perf_counter_ns() - t0)
        times[int(b)] = float(np.median(runs)) / 1e9
    items = sum(int(b) * n for b, n in histogram.items())
    busy = sum(times[int(b)] * n for b, n in histogram.items())
    return {"throughput": items / busy if busy else None, "median_batch_s": times,
            "mean_batch": items / max(1, sum(histogram.values()))}
