"""A client lease driven by hand, as a buggy or hostile caller would drive one: the
tests' hostile cases and bench/isolation.py's attackers."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L
from shmserve.segments import Segment


class RawLease:
    """A client lease driven by hand, as a buggy or hostile caller would: the control
    socket for the lease, then direct writes into its own slots and the ring."""

    def __init__(self, socket_path: Path, arena_bytes: int = 1 << 20):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(socket_path))
        self.sock.sendall(P.pack_frame({"op": P.OP_HELLO, "version": P.PROTOCOL_VERSION,
                                        "pid": os.getpid(), "arena_bytes": arena_bytes}))
        hello, fds = P.recv_frame_fds(self.sock, 2)
        assert hello["ok"], hello
        assert len(fds) == 2, fds
        self.hello = hello
        self.client_id = hello["client_id"]
        self.control = Segment.from_fd(fds[1], hello["control_bytes"], "raw control")
        os.close(fds[1])
        self.arena_fd = fds[0]  # kept open: a hostile caller may ftruncate it
        self.arena = Segment.from_fd(self.arena_fd, hello["arena_bytes"], "raw arena")
        self.ctl, self.ops, self.buf = self.control.ops, self.arena.ops, self.arena.buffer
        self.ring = P.Ring(self.ctl)
        self.arena_bytes = hello["arena_bytes"]
        self.data_offset = hello["data_offset"]
        self.n_slots = hello["n_slots"]
        self.model_ids = {m["name"]: m["id"] for m in hello["models"]}
        self.generations = [0] * self.n_slots

    def slot_offset(self, slot: int) -> int:
        return self.hello["slots_offset"] + slot * P.SLOT_BYTES

    def write_raw_request(self, slot: int, model_id: int, n_inputs: int, n_outputs: int,
                          inputs=(), outputs=()) -> int:
        """Writes a shms_request field by field at the header's offsets (no client-side
        checks at all). Each tensor is (index, dtype, ndim, offset, nbytes, shape[<=8])
        and optionally memory_kind, device_id. Returns the generation to push."""
        off = self.slot_offset(slot)
        req = off + L["slot.request"]
        self.buf[req:req + L["request.size"]] = bytes(L["request.size"])
        for field, value in (("model_id", model_id), ("n_inputs", n_inputs),
                             ("n_outputs", n_outputs)):
            self._put(req, "request", field, value)
        ref = L["tensor_ref.size"]
        for base, tensors in ((req + L["request.inputs"], inputs),
                              (req + L["request.outputs"], outputs)):
            for i, tensor in enumerate(tensors):
                at = base + i * ref
                names = ("index", "dtype", "ndim", "offset", "nbytes", "shape", "memory_kind",
                         "device_id")
                for field, value in zip(names, tensor):
                    if field == "shape":
                        for d, dim in enumerate(value):
                            self._put(at + 8 * d, "tensor_ref", field, dim, width=8)
                    else:
                        self._put(at, "tensor_ref", field, value)
        gen = self.generations[slot] = (self.generations[slot] + 1) & 0xFFFFFFFF
        self._put(off, "slot", "generation", gen)
        self.ops.store32(off + L["slot.state"], P.SlotState.SUBMITTED)
        return gen

    def _put(self, base: int, struct_name: str, field: str, value: int, width: int = 0) -> None:
        """Any integer into a field, cut to the field's width as a hostile client would."""
        width = width or L[f"{struct_name}.{field}.bytes"]
        at = base + L[f"{struct_name}.{field}"]
        self.buf[at:at + width] = (value & (2 ** (8 * width) - 1)).to_bytes(width, "little")

    def push(self, slot: int, gen: int, client_id: int | None = None) -> int:
        cid = self.client_id if client_id is None else client_id
        rc = self.ring.push(cid, slot, gen)
        self.ctl.ring_batcher()
        return rc

    def state(self, slot: int) -> int:
        return self.ops.load32(self.slot_offset(slot) + L["slot.state"])

    def wait_answer(self, slot: int, timeout: float = 10.0):
        """(status, error, results) once the server answered the slot (read_result
        frees it again); None on timeout."""
        off = self.slot_offset(slot)
        deadline = time.monotonic() + timeout
        while self.ops.load32(off + L["slot.state"]) != P.SlotState.DONE:
            if time.monotonic() > deadline:
                return None
            seen = self.ops.load32(L["arena.completions"])
            if self.ops.load32(off + L["slot.state"]) == P.SlotState.DONE:
                break
            self.ops.doorbell_wait(L["arena.completions"], L["arena.waiters"], seen, 0, 20_000_000)
        status, error, results, _ = self.ops.read_result(off)
        return status, error, results

    def free(self, slot: int) -> None:
        self.ops.store32(self.slot_offset(slot) + L["slot.state"], P.SlotState.FREE)

    def wait_done(self, slot: int, timeout: float = 10.0):
        """(status, error) once the server answered the slot, which is freed; None on
        timeout."""
        answer = self.wait_answer(slot, timeout)
        if answer is None:
            return None
        self.free(slot)
        return answer[:2]

    def close(self) -> None:
        self.sock.close()
        self.control.close()
        self.arena.close()
        os.close(self.arena_fd)
