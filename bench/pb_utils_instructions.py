#!/usr/bin/env python3
"""Instructions per request of Triton's python model API against the numpy-dict API,
counted by valgrind's callgrind: deterministic, so unaffected by the machine's load
(the wall-clock counterpart is pb_utils_cost.py).

Both identity models of pb_utils_cost.py run in this process, through the python
backend's own entry points, on one FP32 [1, 1024] request: `numpy-dict` is
Backend.execute(inputs), `pb_utils` Backend.execute_requests(...) as the worker calls
it for a lone request (the requests built, the model's execute(requests), its response
turned back into arrays), and each piece the pb_utils model touches alone. Each case
runs twice under callgrind, with --short and --long iterations: the difference of the
two totals over the difference of the iterations is the cost of one iteration, start-up
(imports) cancelled; `empty loop` is what each figure includes besides its case (the
loop and a call of a lambda).

    python bench/pb_utils_instructions.py            # about 2 minutes (valgrind is slow)
    python bench/pb_utils_instructions.py --cases numpy-dict pb_utils
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

CASES = ("empty loop", "numpy-dict", "pb_utils", "requests built", "get_input_tensor_by_name",
         "Tensor(...)", "InferenceResponse(...)", "response unpacked")


# Without these the totals of two identical runs differ by millions: BLAS threads spin
# for as long as the scheduler lets them, and str hashes change the dicts' probing.
DETERMINISTIC = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                 "MKL_NUM_THREADS": "1"}


def setup(case: str):
    """The loop body of a case, as a function of no arguments."""
    import numpy as np

    from pb_utils_cost import IDENTITY_PB_CODE
    from shmserve import pb_utils
    from shmserve.backends import python_backend
    from shmserve.pb_utils.messages import received

    x = np.zeros((1, 1024), np.float32)
    if case == "empty loop":  # what every case's figure includes: the loop, a lambda call
        return lambda: None
    inputs = {"INPUT0": x}
    names = ("OUTPUT0",)

    def backend_of(code: str):
        path = Path(tempfile.mkdtemp()) / "model.py"
        path.write_text(code)
        module, _ = python_backend.import_model(str(path), f"bench_model_{len(code)}")
        backend = object.__new__(python_backend.Backend)  # no spec, server, nor initialize
        backend.model, backend._loop = module.TritonPythonModel(), None
        return backend

    if case == "numpy-dict":
        numpy_model = backend_of((ROOT / "model_repository/identity/1/model.py").read_text())
        return lambda: numpy_model.execute(inputs)
    pb_model = backend_of(IDENTITY_PB_CODE)
    lone = [(inputs, names, {})]  # as the worker passes a lone request
    if case == "pb_utils":
        return lambda: pb_model.execute_requests(lone)
    if case == "requests built":
        return lambda: received(lone)
    (request,) = received(lone)
    tensor = pb_utils.Tensor("OUTPUT0", x)
    response = pb_utils.InferenceResponse(output_tensors=[tensor])
    if case == "get_input_tensor_by_name":
        return lambda: pb_utils.get_input_tensor_by_name(request, "INPUT0")
    if case == "Tensor(...)":
        return lambda: pb_utils.Tensor("OUTPUT0", x)
    if case == "InferenceResponse(...)":
        return lambda: pb_utils.InferenceResponse(output_tensors=[tensor])
    if case == "response unpacked":
        # execute_requests on a model whose execute() returns a response made already
        pb_model.model.execute = lambda requests: [response]
        return lambda: pb_model.execute_requests(lone)
    raise SystemExit(f"unknown case {case!r} (cases: {', '.join(CASES)})")


def run_case(case: str, n: int) -> None:
    body = setup(case)
    body()  # the first call: caches filled, specialised
    for _ in range(n):
        body()


def instructions(case: str, n: int, workdir: Path) -> int:
    out = workdir / f"cg.{abs(hash((case, n)))}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    sys.executable, __file__, "--inner", case, str(n)],
                   check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT), **DETERMINISTIC})
    totals = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
    return int(totals.group(1))


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--inner":
        run_case(sys.argv[2], int(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--short", type=int, default=1000)
    p.add_argument("--long", type=int, default=11000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pb-utils-cg-") as tmp:
        print(f"| case | instructions per call |\n|---|---:|")
        for case in args.cases:
            per = (instructions(case, args.long, Path(tmp))
                   - instructions(case, args.short, Path(tmp)))
            print(f"| {case} | {per / (args.long - args.short):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
