#!/usr/bin/env bash
# Fresh machine to answers: sets up .venv, generates the bundled models, serves
# model_repository/, shows it answering from Python over shared memory, stops it.
#   bash scripts/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
NAME="quickstart-$$"
$PY -m shmserve.cli serve --model-repository model_repository --name "$NAME" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  $PY -m shmserve.cli models --name "$NAME" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited" >&2; exit 1; }
  sleep 0.5
done
echo "== shmserve models"
$PY -m shmserve.cli models --name "$NAME"
echo "== shmserve infer simple (Triton's client example model)"
$PY -m shmserve.cli infer simple --name "$NAME"
echo "== shmserve infer identity, 4 KiB, 5000 round trips"
$PY -m shmserve.cli infer identity --shape INPUT0=1024 --repeat 5000 --name "$NAME" | tail -1
echo "== shmserve infer mlp (ONNX Runtime), 2000 round trips"
$PY -m shmserve.cli infer mlp --repeat 2000 --name "$NAME" | tail -1
echo "== from Python"
$PY - "$NAME" <<'PY'
import sys
import numpy as np
import shmserve

with shmserve.Client(sys.argv[1]) as client:
    a = np.arange(16, dtype=np.int32)[None]
    with client.infer("simple", {"INPUT0": a, "INPUT1": np.ones_like(a)}) as out:
        print("simple: OUTPUT0 =", out["OUTPUT0"][0][:6], "... OUTPUT1 =", out["OUTPUT1"][0][:6], "...")
    x = client.empty((1, 256), np.float32)   # lives in shared memory: no copy on the way in
    x[:] = 1.0
    print("mlp:", client.infer("mlp", {"INPUT0": x}, copy=True)["OUTPUT0"][0][:4], "...")
PY
