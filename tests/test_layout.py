"""The shared-memory layout: what the compiled extension reports equals what
csrc/shmserve.h pins with _Static_assert, and the numbers a third-party client would
hard-code (docs/protocol.md) never change silently."""
from __future__ import annotations

import re

from helpers import REPO_ROOT
from tritonclient.grpc import model_config_pb2 as mc

from shmserve import _core
from shmserve.protocol import DTYPE_CODES, LAYOUT, SLOT_BYTES
from shmserve.server.segments import ArenaLayout, ServerLayout, control_ring_offset

PINNED = {
    "tensor_ref.size": 96,
    "request.size": 32 + 2 * 16 * 96,
    "ring_cell.size": 32,
    "control.size": 256,
    "control.enqueue_pos": 64,
    "control.dequeue_pos": 128,
    "control.doorbell": 192,
    "slot.size": 4992,
    "slot.request": 336,
    "slot.results": 3440,
    "arena.size": 128,
    "arena.completions": 64,
    "client_entry.size": 88,
    "tensor_spec.size": 136,
    "shadow.size": 24 + 32 + 2 * 16 * 96,
    "mailbox.size": 40 + 4 * 256,
    "server.size": 80,
    "MAX_TENSORS": 16,
    "MAX_DIMS": 8,
    "ERROR_BYTES": 256,
    "NAME_BYTES": 64,
    "MAX_BATCH_REQUESTS": 256,
    "DATA_ALIGN": 64,
    "PROTOCOL_VERSION": 2,
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
    header = (REPO_ROOT / "shmserve" / "csrc" / "shmserve.h").read_text()
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
    assert arena.slots_offset % 64 == 0 and arena.slots_offset >= LAYOUT["arena.size"]
    assert arena.data_offset % 4096 == 0
    assert arena.data_offset >= arena.slot(31) + SLOT_BYTES
    assert arena.segment_bytes - arena.data_offset >= 1 << 20
    assert control_ring_offset() % 64 == 0 and control_ring_offset() >= LAYOUT["control.size"]
    srv = ServerLayout(max_clients=5, slots_per_client=3, n_models=2, n_workers=4)
    regions = [(LAYOUT["server.size"], srv.clients_offset),
               (srv.clients_offset + 5 * LAYOUT["client_entry.size"], srv.models_offset),
               (srv.models_offset + 2 * LAYOUT["model.size"], srv.shadows_offset),
               (srv.shadows_offset + 15 * LAYOUT["shadow.size"], srv.mailboxes_offset),
               (srv.mailboxes_offset + 4 * LAYOUT["mailbox.size"], srv.size)]
    for end_of_previous, start in regions:
        assert start % 64 == 0 and start >= end_of_previous
