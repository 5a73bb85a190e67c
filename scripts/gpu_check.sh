#!/usr/bin/env bash
# The whole GPU check in one short call on a machine with an NVIDIA GPU (docs/gpu.md):
#   scripts/gpu_wheels.sh                      # here, once: the wheels the device lacks
#   (device) bash scripts/gpu_check.sh         # carry .whl; a few minutes
# Builds the C core for the machine's python3, makes the bundled models, runs the GPU
# tests (tests/test_gpu.py, test_gpu_ipc.py, test_tensorrt.py: -m gpu ones included, each skip
# with its reason) and bench/gpu_check.py, and prints a summary. Logs go to $OUT (the
# device tool's folder) or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/shmserve-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/shmserve-site
fi
export PYTHONPATH="$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
$PY - <<'PYEOF'
import importlib
for name in ("torch", "cupy", "onnxruntime", "tensorrt", "pynvml", "tritonclient"):
    try:
        m = importlib.import_module(name)
        extra = ""
        if name == "torch":
            extra = f" cuda={m.version.cuda} available={m.cuda.is_available()}"
        if name == "onnxruntime":
            extra = f" providers={m.get_available_providers()}"
        print(f"{name} {getattr(m, '__version__', '?')}{extra}")
    except Exception as e:
        print(f"{name}: missing ({type(e).__name__}: {e})")
PYEOF
echo "== build"
INC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUF=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
gcc -shared -fPIC -std=gnu11 -O2 -Wall -Wno-unused-parameter -Wno-missing-field-initializers \
  -I"$INC" -Ishmserve/csrc shmserve/csrc/*.c -o "shmserve/_core$SUF" || exit 1
$PY scripts/make_models.py >/dev/null || exit 1
echo "== tests"
# GPU_TESTS: a shorter list, for a rerun after a fix. The C++ client's device test
# builds clients/cpp first (skipped, saying so, without cmake, g++ and msgpack-cxx).
CPP_GPU_TEST=tests/test_cpp_client.py::test_cpp_client_sends_device_tensors_by_cuda_ipc
$PY -m pytest -p no:cacheprovider -q -rs ${GPU_TESTS:-tests/test_gpu.py tests/test_gpu_ipc.py tests/test_tensorrt.py $CPP_GPU_TEST} 2>&1 \
  | tee "$LOGS/pytest.log"
tests=${PIPESTATUS[0]}
echo "== bench"
timeout 300 $PY bench/gpu_check.py 2>&1 | tee "$LOGS/bench.txt"
echo "== summary"
tail -n 1 "$LOGS/pytest.log"
grep -E "^(copies|round trip|stages):" "$LOGS/bench.txt" || true
exit "$tests"
