#!/usr/bin/env bash
# libFuzzer campaign of the C core (tests/fuzz/shms_fuzz.c; docs/reliability.md).
#
#   scripts/fuzz_core.sh build                 harness + coverage build, model table, seeds
#   scripts/fuzz_core.sh run TARGET [SECONDS] [libFuzzer flags]
#                                              fuzz build/fuzz/corpus/TARGET (one process)
#   scripts/fuzz_core.sh merge TARGET          minimise it into tests/fuzz_corpus/TARGET
#   scripts/fuzz_core.sh cov [TARGET...]       line/branch coverage of csrc over the corpora
#   scripts/fuzz_core.sh replay [TARGET...]    tests/fuzz_corpus/TARGET through the harness
#
# TARGET: take | ring | answer. Needs clang (14+) with its sanitizer and libFuzzer
# runtimes (Debian: clang-14, libclang-rt-14-dev), llvm-profdata and llvm-cov; the
# Python of PY (default .venv/bin/python, else python3) with shmserve importable.
# CI replays the committed corpora without clang (tests/test_fuzz_core.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${SHMS_FUZZ_OUT:-build/fuzz}  # where builds, seeds and the working corpora go
case $OUT in /*) ;; *) OUT=$ROOT/$OUT ;; esac
CC=${CC:-clang}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
TARGETS=(take ring answer)
export SHMS_FUZZ_MODELS=$OUT/models.bin

# Exit status 3: a piece of the toolchain is missing (tests/test_fuzz_core.py skips then).
need() { command -v "$1" >/dev/null || { echo "fuzz_core.sh: $1 not found ($2)" >&2; exit 3; }; }

fuzzer_lib() {
  # libFuzzer without its main(): the harness's main picks the target and calls
  # LLVMFuzzerRunDriver. clang's own (libclang-rt-*-dev), else the copy atheris ships.
  local lib
  lib=$("$CC" -print-file-name=libclang_rt.fuzzer_no_main-x86_64.a)
  if [ ! -f "$lib" ]; then
    lib=$(find "$(dirname "$(dirname "$($CC -print-libgcc-file-name)")")" \
      -name 'libclang_rt.fuzzer_no_main*.a' 2>/dev/null | head -1)
  fi
  if [ ! -f "$lib" ]; then
    lib=$("$PY" -c 'import atheris, os; print(os.path.join(os.path.dirname(os.path.dirname(atheris.__file__)), "libclang_rt.fuzzer_no_main.a"))' 2>/dev/null || true)
  fi
  [ -f "$lib" ] || { echo "fuzz_core.sh: no libclang_rt.fuzzer_no_main (install libclang-rt-14-dev)" >&2; exit 3; }
  echo "$lib"
}

build() {
  need "$CC" "install clang"
  mkdir -p "$OUT"
  echo 'int main(void) { return 0; }' > "$OUT/probe.c"
  "$CC" -fsanitize=address,undefined "$OUT/probe.c" -o "$OUT/probe" 2>/dev/null || {
    echo "fuzz_core.sh: $CC cannot link -fsanitize=address,undefined (its sanitizer runtimes are missing; Debian: libclang-rt-14-dev)" >&2
    exit 3
  }
  local lib common
  lib=$(fuzzer_lib)
  common=(-std=gnu11 -g -Ishmserve/csrc tests/fuzz/shms_fuzz.c "$lib" -lstdc++ -lm -lpthread)
  # The fuzzer: coverage-guided (sanitizer coverage of every edge of the code it includes),
  # ASan + UBSan, any UB report fatal.
  "$CC" -O1 -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all \
    -fno-omit-frame-pointer "${common[@]}" -o "$OUT/shms_fuzz"
  # The same source with clang's source-based coverage, to measure a corpus.
  "$CC" -O0 -fprofile-instr-generate -fcoverage-mapping "${common[@]}" -o "$OUT/shms_fuzz_cov"
  "$PY" scripts/fuzz_core_inputs.py models "$OUT/models.bin"
  rm -rf "$OUT/seeds"
  "$PY" scripts/fuzz_core_inputs.py seeds "$OUT/seeds"
  echo "built $OUT/shms_fuzz, $OUT/shms_fuzz_cov; seeds in $OUT/seeds"
}

# Longest input: a slot (4992 bytes) for answer; take and ring need less than 4096.
max_len() { [ "$1" = answer ] && echo 5000 || echo 4096; }

check_target() {
  case " ${TARGETS[*]} " in *" $1 "*) ;; *) echo "fuzz_core.sh: unknown target '$1' (${TARGETS[*]})" >&2; exit 2;; esac
}

run() {
  local target=$1 secs=${2:-60}
  check_target "$target"
  shift; [ $# -gt 0 ] && shift
  mkdir -p "$OUT/corpus/$target" "$OUT/artifacts"
  # One process (the machine is shared). Starts from the committed corpus and the seeds.
  "$OUT/shms_fuzz" "$target" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -max_len="$(max_len "$target")" -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$target-" "$@" \
    "$OUT/corpus/$target" "tests/fuzz_corpus/$target" "$OUT/seeds/$target"
}

merge() {
  local target=$1
  check_target "$target"
  local dest=tests/fuzz_corpus/$target
  rm -rf "$OUT/merged-$target"
  mkdir -p "$OUT/merged-$target" "$dest"
  "$OUT/shms_fuzz" "$target" -merge=1 -max_len="$(max_len "$target")" "$OUT/merged-$target" "$dest" \
    "$OUT/corpus/$target" "$OUT/seeds/$target"
  # Replace the committed corpus only with a merge that kept something.
  if [ -z "$(ls -A "$OUT/merged-$target")" ]; then
    echo "fuzz_core.sh: the merge of $target kept nothing; $dest left as it was" >&2
    exit 1
  fi
  rm -f "$dest"/*
  cp "$OUT/merged-$target"/* "$dest/"
  echo "$dest: $(ls "$dest" | wc -l) files, $(du -sk "$dest" | cut -f1) KiB"
}

cov() {
  need llvm-profdata "install llvm-14"; need llvm-cov "install llvm-14"
  local targets=("$@")
  [ ${#targets[@]} -gt 0 ] || targets=("${TARGETS[@]}")
  rm -f "$OUT"/cov-*.profraw
  for t in "${targets[@]}"; do
    check_target "$t"
    # Each file given alone is run once (libFuzzer's replay mode).
    LLVM_PROFILE_FILE="$OUT/cov-$t.profraw" \
      "$OUT/shms_fuzz_cov" "$t" tests/fuzz_corpus/"$t"/* >/dev/null 2>&1
  done
  llvm-profdata merge -sparse "$OUT"/cov-*.profraw -o "$OUT/cov.profdata"
  llvm-cov report "$OUT/shms_fuzz_cov" -instr-profile="$OUT/cov.profdata" \
    -show-branch-summary shmserve/csrc/shms_request.h shmserve/csrc/shms_ring.h \
    shmserve/csrc/shms_slot.h shmserve/csrc/shms_segments.h shmserve/csrc/shms_layout.h
  llvm-cov show "$OUT/shms_fuzz_cov" -instr-profile="$OUT/cov.profdata" -format=html \
    -show-branches=count -output-dir="$OUT/cov-html" shmserve/csrc >/dev/null
  echo "line/branch detail: $OUT/cov-html/index.html"
}

replay() {
  local targets=("$@")
  [ ${#targets[@]} -gt 0 ] || targets=("${TARGETS[@]}")
  for t in "${targets[@]}"; do
    check_target "$t"
    "$OUT/shms_fuzz" "$t" -runs=0 tests/fuzz_corpus/"$t"
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  build) build ;;
  run) [ $# -ge 1 ] || { echo "usage: $0 run TARGET [SECONDS] [libFuzzer flags]" >&2; exit 2; }; run "$@" ;;
  merge) [ $# -eq 1 ] || { echo "usage: $0 merge TARGET" >&2; exit 2; }; merge "$1" ;;
  cov) cov "$@" ;;
  replay) replay "$@" ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
