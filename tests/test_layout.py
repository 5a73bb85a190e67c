"""The shared-memory layout: what the compiled extension reports equals what
csrc/shms_layout.h pins with _Static_assert, the numbers a third-party client would
hard-code (docs/protocol.md) never change silently, and Python's view of every struct
and enum comes from the header (a scratch build that moves a field is followed)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig

import pytest
from helpers import REPO_ROOT
from tritonclient.grpc import model_config_pb2 as mc

from shmserve import _core
from shmserve import protocol as P
from shmserve.protocol import DTYPE_CODES, LAYOUT, SLOT_BYTES
from shmserve.server.segments import ArenaLayout, ServerLayout

PINNED = {
    "tensor_ref.size": 96,
    "request.size": 64 + 2 * 16 * 96,
    "request.inputs": 64,
    "request.priority": 16,
    "request.parameters_bytes": 20,
    "request.timeout_us": 24,
    "request.parameters_offset": 32,
    "request.sequence_id": 40,
    "request.sequence_id_offset": 48,
    "request.sequence_id_bytes": 56,
    "ring_cell.size": 32,
    "control.size": 64,
    "control.crowded": 36,
    "control.batcher_sleeping": 40,
    "bell.size": 64,
    "bell.doorbell": 0,
    "slot.size": 5056,
    "slot.request": 336,
    "slot.results": 3472,
    "slot.response_index": 5008,
    "slot.response_flags": 5012,
    "slot.cancel": 5016,
    "slot.stream_sleeping": 5020,
    "arena.size": 192,
    "arena.ring_offset": 48,
    "arena.ring_capacity": 56,
    "arena.rang_token": 60,
    "arena.completions": 64,
    "arena.enqueue_pos": 128,
    "client_entry.size": 96,
    "client_entry.ring_pos": 88,
    "tensor_spec.size": 136,
    "shadow.size": 32 + 64 + 2 * 16 * 96,
    "mailbox.size": 80 + 8 * 256,  # two batches deep: shadow[] and next_shadow[]
    "server.size": 104,
    "MAX_TENSORS": 16,
    "MAX_DIMS": 8,
    "ERROR_BYTES": 256,
    "NAME_BYTES": 64,
    "MAX_BATCH_REQUESTS": 256,
    "DATA_ALIGN": 64,
    "PROTOCOL_VERSION": 5,
    "MAX_PARAMETER_BYTES": 65536,
    "MAGIC_CONTROL": int.from_bytes(b"SHMSCTL1", "little"),
    "MAGIC_ARENA": int.from_bytes(b"SHMSARN1", "little"),
    "MAGIC_SERVER": int.from_bytes(b"SHMSSRV1", "little"),
}


def test_layout_matches_pinned_numbers():
    layout = _core.layout()
    assert {k: layout[k] for k in PINNED} == PINNED
    assert LAYOUT == layout and SLOT_BYTES == PINNED["slot.size"]


def test_layout_matches_header_static_asserts():
    """Every _Static_assert of shmserve.h, evaluated with the extension's numbers."""
    header = (REPO_ROOT / "shmserve" / "csrc" / "shms_layout.h").read_text()
    layout = _core.layout()
    constants = {f"SHMS_{k}": v for k, v in layout.items() if k.isupper()}

    def key(struct_name: str, field: str | None) -> str:
        name = struct_name.removeprefix("shms_").replace("arena_header", "arena") \
            .replace("server_header", "server").replace("model_entry", "model")
        return f"{name}.{field or 'size'}"

    def value(expr: str) -> int:
        expr = re.sub(r"sizeof\((\w+)\)", lambda m: str(layout[key(m.group(1), None)]), expr)
        for name, v in constants.items():
            expr = expr.replace(name, str(v))
        assert re.fullmatch(r"[\d\s+*%()]+", expr), expr
        return eval(expr)  # arithmetic on literals only (checked above)

    asserts = re.findall(r"SHMS_STATIC_ASSERT\((.+?), \"", header)
    assert len(asserts) >= 15
    for a in asserts:
        lhs, rhs = a.split(" == ")
        m = re.fullmatch(r"offsetof\((\w+), (\w+)\)", lhs)
        got = layout[key(m.group(1), m.group(2))] if m else value(lhs)
        assert got == value(rhs), a


def test_dtype_codes_are_tritons():
    for name, code in DTYPE_CODES.items():
        triton = "TYPE_STRING" if name == "BYTES" else f"TYPE_{name}"
        assert mc.DataType.Value(triton) == code, name


def test_python_layouts_are_aligned_and_disjoint():
    arena = ArenaLayout.for_data(32, 1 << 20)
    assert arena.ring_offset % 64 == 0 and arena.ring_offset >= LAYOUT["arena.size"]
    assert arena.ring_capacity == 32  # a power of two, one cell per slot at least
    assert arena.slots_offset % 64 == 0
    assert arena.slots_offset >= arena.ring_offset + 32 * LAYOUT["ring_cell.size"]
    assert (arena.ring_offset, arena.slots_offset, arena.data_offset) == (192, 0x4C0, 0x28000)
    assert arena.data_offset % 4096 == 0
    assert arena.data_offset >= arena.slot(31) + SLOT_BYTES
    assert arena.segment_bytes - arena.data_offset >= 1 << 20
    srv = ServerLayout(max_clients=5, slots_per_client=3, n_models=2, n_workers=4)
    regions = [(LAYOUT["server.size"], srv.clients_offset),
               (srv.clients_offset + 5 * LAYOUT["client_entry.size"], srv.models_offset),
               (srv.models_offset + 2 * LAYOUT["model.size"], srv.shadows_offset),
               (srv.shadows_offset + 15 * LAYOUT["shadow.size"], srv.mailboxes_offset),
               (srv.mailboxes_offset + 4 * LAYOUT["mailbox.size"], srv.size)]
    for end_of_previous, start in regions:
        assert start % 64 == 0 and start >= end_of_previous


def test_enums_come_from_the_header():
    enums = _core.enums()
    for name, members in enums.items():
        python = getattr(P, name)
        assert {m.name: int(m) for m in python} == members, name
    assert enums["Status"]["SERVER_DEAD"] != enums["Status"]["TIMEOUT"]
    assert enums["Status"]["SERVER_DEAD"] != enums["Status"]["UNAVAILABLE"]


def test_every_field_has_offset_and_size():
    for key, value in LAYOUT.items():
        if key.endswith(".bytes"):
            struct_name = key.split(".")[0]
            offset = LAYOUT[key.removesuffix(".bytes")]
            assert offset + value <= LAYOUT[f"{struct_name}.size"], key


PROBE = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("shmserve._core", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
sys.modules["shmserve._core"] = probe
import shmserve
shmserve._core = probe
from shmserve import protocol as P
from shmserve.server.segments import ArenaLayout
import mmap
lay = ArenaLayout.for_data(2, 1 << 16)
mm = mmap.mmap(-1, lay.segment_bytes)
ops = probe.Mapping(mm)
ops.init_arena(2, 1 << 16, 7, 1)
ops.check_header("arena")
slot = lay.slot(1)
ops.write_request(slot, 5, 42, [(0, P.DataType.FP32, lay.data_offset, 12, (1, 3))],
                  [(0, 0, lay.data_offset + 64, 64, ())])
req = slot + P.LAYOUT["slot.request"]
first = req + P.LAYOUT["request.inputs"]
print(P.LAYOUT["slot.request"], P.SLOT_BYTES, ops.load32(req + P.LAYOUT["request.model_id"]),
      ops.load32(slot + P.LAYOUT["slot.state"]) == P.SlotState.SUBMITTED,
      ops.load64(first + P.LAYOUT["tensor_ref.shape"] + 8))
"""


@pytest.mark.timeout(180)
def test_python_follows_a_moved_field(tmp_path):
    """A scratch build of the C core with SHMS_LAYOUT_PROBE moves shms_slot.request
    by 64 bytes: Python's offsets, sizes and arena layout follow it, and a request
    written by the C core is read back by Python where the header put it."""
    csrc = REPO_ROOT / "shmserve" / "csrc"
    include = sysconfig.get_paths()["include"]
    out = tmp_path / ("_core" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-shared", "-fPIC", "-std=gnu11", "-O0", "-DSHMS_LAYOUT_PROBE",
                    f"-I{csrc}", f"-I{include}", *map(str, sorted(csrc.glob("*.c"))),
                    "-o", str(out)], check=True)
    got = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True,
                         text=True, check=True).stdout.split()
    assert got == [str(PINNED["slot.request"] + 64), str(PINNED["slot.size"] + 64), "42",
                   "True", "3"]


@pytest.mark.parametrize("message", ["", "short", "é" * 63, "é" * 64, "€" * 85, "€" * 86,
                                     "𝄞" * 63, "𝄞" * 64, "x" * 300])
def test_clip_error_fits_the_error_field_on_a_character_boundary(message):
    from shmserve.protocol import ERROR_BYTES, clip_error

    clipped = clip_error(message)
    assert len(clipped.encode()) <= ERROR_BYTES - 1
    assert message.startswith(clipped)
    if len(message.encode()) <= ERROR_BYTES - 1:
        assert clipped == message  # never cut what fits
    else:  # cut at the last whole character that fits
        assert len(clipped.encode()) + len(message[len(clipped)].encode()) > ERROR_BYTES - 1
