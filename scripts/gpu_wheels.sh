#!/usr/bin/env bash
# Run HERE (with package registries), before a GPU check on a lent device machine,
# which cannot download: saves into .whl/ (ignored by git) the wheels shmserve needs
# that the device image lacks (its python3 is 3.12 with torch, cupy, numpy, protobuf,
# grpcio, msgpack, prometheus-client, psutil, rich, uvloop, pytest; docs/gpu.md).
# The device call then carries .whl (scripts/gpu_check.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  "tritonclient==2.73.0" "posix_ipc==1.3.2" "uvicorn==0.55.0" "httptools==0.9.0" \
  "pytest-timeout==2.4.0" "python-rapidjson==1.23"
ls -la .whl
