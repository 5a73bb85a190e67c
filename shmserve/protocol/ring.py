"""This process's view of the request ring (shms_ring in csrc/shmserve.h)."""
from __future__ import annotations

import enum

class RingResult(enum.IntEnum):
    OK = 0
    FULL = 1
    RECLAIMED = 2


POP_OK, POP_STALLED, POP_CORRUPT = 1, 2, 3  # shms_pop_result (EMPTY comes back as None)


class Ring:
    """This process's view of the request ring: offset and capacity are checked once,
    at attach, and never re-read from the client-writable header (shms_ring)."""

    def __init__(self, ctl_ops):
        self.ops = ctl_ops
        self.offset, self.capacity = ctl_ops.ring_attach()

    def push(self, owner: int, slot: int, generation: int) -> int:
        return self.ops.ring_push(self.offset, self.capacity, owner, slot, generation)


class RingConsumer(Ring):
    """The batcher's side: `pos`, the next position to take, is private to it."""

    def __init__(self, ctl_ops, pos: int):
        super().__init__(ctl_ops)
        self.pos = pos

    def pop(self):
        """None (empty), or (POP_OK, client, slot, generation), (POP_STALLED, owner,
        head_seq, 0), (POP_CORRUPT, 0, head_seq, 0)."""
        got = self.ops.ring_pop(self.offset, self.capacity, self.pos)
        if got is not None and got[0] == POP_OK:
            self.pos += 1
        return got

    def skip(self, head_seq: int) -> bool:
        if self.ops.ring_skip(self.offset, self.capacity, self.pos, head_seq):
            self.pos += 1
            return True
        return False

    def repair(self) -> bool:
        return self.ops.ring_repair(self.offset, self.capacity, self.pos)

    def pending(self) -> list[tuple[int, int, int]]:
        return self.ops.ring_pending(self.offset, self.capacity, self.pos)
