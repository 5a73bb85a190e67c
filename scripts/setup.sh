#!/usr/bin/env bash
# Creates .venv with shmserve (C core compiled by the package build), ONNX Runtime
# and the test tools, and generates the bundled models. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import shmserve._core, onnxruntime, pytest_timeout" \
  || { echo "setup: installation incomplete" >&2; exit 1; }
.venv/bin/python scripts/make_models.py
