"""The libFuzzer corpora of the C core (tests/fuzz_corpus/<target>/, from
scripts/fuzz_core.sh's campaign; docs/reliability.md) replayed in CI.

Every input goes through the gcc-built extension as the harness (tests/fuzz/shms_fuzz.c)
reads it — Mapping.take for `take` (Intake.take's call), the ring calls for `ring`,
read_result for `answer` — with the campaign's checks, and `take` answers compared with
the Python reference of protocol.md section 11 (scripts/fuzz_core_inputs.py). Each
target runs in a child process: a crash in the C core fails the test instead of
killing pytest. No clang needed; where clang is installed, the corpora are also
replayed through the sanitizer build of the harness.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

CORPUS = REPO_ROOT / "tests" / "fuzz_corpus"
INPUTS = REPO_ROOT / "scripts" / "fuzz_core_inputs.py"
TARGETS = ("take", "ring", "answer")

pytestmark = pytest.mark.timeout(120)


def replay(*args: str) -> dict[str, int]:
    """fuzz_core_inputs.py replay ARGS in a child; -> outcome counts."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, str(INPUTS), *args], capture_output=True, text=True,
                       timeout=100, env=env)
    assert r.returncode == 0, f"{args} failed (rc {r.returncode}):\n{r.stderr[-3000:]}"
    m = re.search(r"replayed (\d+) [\w ]+: (\{.*\})", r.stdout)
    assert m, r.stdout
    counts = eval(m.group(2), {})  # a dict literal of str -> int printed by the child
    assert sum(counts.values()) == int(m.group(1))
    return counts


@pytest.mark.parametrize("target", TARGETS)
def test_corpus_replays_through_the_extension(target):
    files = [f for f in (CORPUS / target).iterdir() if f.is_file()]
    assert len(files) >= 5, f"tests/fuzz_corpus/{target} holds {len(files)} inputs"
    counts = replay("replay", target, str(CORPUS / target))
    assert sum(counts.values()) == len(files)
    if target == "take":
        # The minimised corpus still reaches acceptance and every refusal the campaign
        # reached: checks 1-17 (4a, 15a), NOT_FOUND, UNAVAILABLE, stale slots.
        want = {"OK", "stale", "NOT_FOUND", "UNAVAILABLE", "1", "2", "3", "4", "4a", "5", "6",
                "7", "8", "9", "10", "11", "12", "13", "14", "15", "15a", "16", "17"}
        assert want <= set(counts), f"outcomes not reached: {sorted(want - set(counts))}"
    elif target == "ring":
        assert set(counts) == {"ran", "refused"}, counts
    else:
        assert {"OK", "OUTPUT_TOO_SMALL", "INVALID_ARG"} <= set(counts), counts


def test_bounds_at_the_edges_of_the_callers_data():
    """What an edge-minimised corpus need not hold: offsets and sizes one byte or one
    alignment unit inside and outside [data_offset, arena size), and wrapping 2^64,
    for an input and an output of every model (fuzz_core_inputs.take_edges), answered
    as protocol.md section 11 says."""
    counts = replay("replay-edges")
    assert {"OK", "11", "16"} <= set(counts), counts


@pytest.mark.timeout(300)
def test_corpus_replays_through_the_sanitizer_harness(tmp_path):
    if not shutil.which("clang"):
        pytest.skip("clang is not installed: the sanitizer harness (scripts/fuzz_core.sh) "
                    "cannot be built here; the corpora were replayed through the extension")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PY=sys.executable,
               SHMS_FUZZ_OUT=str(tmp_path))
    script = str(REPO_ROOT / "scripts" / "fuzz_core.sh")
    b = subprocess.run(["bash", script, "build"], capture_output=True, text=True, env=env,
                       timeout=240)
    if b.returncode == 3:  # a toolchain piece is missing; the script says which
        pytest.skip(b.stderr.strip())
    assert b.returncode == 0, b.stderr[-3000:]
    r = subprocess.run(["bash", script, "replay", *TARGETS], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("DONE ") == len(TARGETS), r.stderr[-3000:]
