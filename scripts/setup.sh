#!/usr/bin/env bash
# Creates .venv with shmserve (C core compiled by the package build), ONNX Runtime
# and the test tools, and generates the bundled models. Idempotent.
# The kserve SDK goes in without its dependencies: tests/test_deploy.py reads only its
# generated models' sources; its server dependencies pin psutil<6, which conflicts with
# this project's psutil 7, and pull fastapi, pandas, grpcio-tools, cryptography...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
LOG=.venv/setup.log
if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip \
       && .venv/bin/python -m pip install --disable-pip-version-check -e '.[test]' \
       && .venv/bin/python -m pip install --disable-pip-version-check --no-deps kserve==0.21.0; \
     } >"$LOG" 2>&1 \
   || ! .venv/bin/python -c "import shmserve._core, onnxruntime, pytest_timeout"; then
  tail -40 "$LOG" >&2
  echo "setup: installation failed (full log: $LOG)" >&2
  exit 1
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import shmserve; print("shmserve", shmserve.__version__)'))"
.venv/bin/python scripts/make_models.py
