"""The time slice the batcher and workers ask of the kernel (`serve --sched-slice-us`,
_core.set_sched_slice): EEVDF's custom slice of Linux >= 6.12, read back from
/proc/<pid>/sched. On an older kernel the call is a no-op that says so (0)."""
from __future__ import annotations

import re
import threading

import pytest

from shmserve import _core

from helpers import wait_until
from test_lifecycle import _server_children

pytestmark = pytest.mark.timeout(120)


def slice_of(pid: int | str = "self") -> int | None:
    """se.slice of /proc/<pid>/sched in ns (None: the kernel shows none)."""
    try:
        text = open(f"/proc/{pid}/sched").read()
    except OSError:
        return None
    found = re.search(r"^se\.slice\s*:\s*(\d+)", text, re.M)
    return int(found.group(1)) if found else None


def custom_slices() -> bool:
    """Whether this kernel takes a custom slice (probed in a thread of its own)."""
    got = []
    t = threading.Thread(target=lambda: got.append(_core.set_sched_slice(300_000)))
    t.start()
    t.join()
    return got[0] == 300_000


needs_custom_slices = pytest.mark.skipif(
    not custom_slices() or slice_of() is None,
    reason="this kernel has no custom EEVDF slices (Linux < 6.12) or no /proc/<pid>/sched")


@needs_custom_slices
def test_set_sched_slice_sets_the_calling_thread_and_0_puts_the_default_back():
    default = slice_of()
    result = {}

    def in_thread():
        result["set"] = _core.set_sched_slice(250_000)
        result["seen"] = slice_of(f"self/task/{threading.get_native_id()}")
        result["reset"] = _core.set_sched_slice(0)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert result["set"] == result["seen"] == 250_000
    assert result["reset"] == default and slice_of() == default  # this thread untouched


@needs_custom_slices
@pytest.mark.parametrize("flag, want", [((), 100_000), (("--sched-slice-us", "2000"), 2_000_000),
                                        (("--sched-slice-us", "0"), None)])
def test_the_batcher_and_workers_run_with_the_slice_asked_for(server_factory, flag, want):
    server = server_factory(args=list(flag))
    children = _server_children(server)
    assert sorted(children.values()) == ["batcher", "worker"], children
    want = want or slice_of()
    # each sets it once it has read its boot message, which a READY server's batcher
    # may not have done yet
    wait_until(lambda: all(slice_of(pid) == want for pid in children), 20,
               f"a slice of {want} ns", state=lambda: {children[p]: slice_of(p) for p in children})


def test_a_slice_out_of_range_is_refused_naming_the_flag(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                          str(tmp_path), "--sched-slice-us", "50"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "--sched-slice-us must be 0 (the kernel's default) or 100 to 100000, not 50" in out.stderr
