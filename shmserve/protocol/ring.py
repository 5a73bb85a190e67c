"""This process's view of the request ring (shms_ring in csrc/shmserve.h)."""
from __future__ import annotations

from .layout import PopResult

# shms_pop_result; EMPTY comes back as None
POP_OK, POP_STALLED, POP_CORRUPT = PopResult.OK, PopResult.STALLED, PopResult.CORRUPT


class Ring:
    """This process's view of the request ring: offset and capacity are checked once,
    at attach, and never re-read from the client-writable header (shms_ring)."""

    def __init__(self, ctl_ops):
        self.ops = ctl_ops
        self.offset, self.capacity = ctl_ops.ring_attach()

    def push(self, owner: int, slot: int, generation: int) -> int:
        """One push attempt (tests and tools); clients use push_request."""
        return self.ops.ring_push(self.offset, self.capacity, owner, slot, generation)

    def push_request(self, owner: int, slot: int, generation: int, check_lease) -> int:
        """Pushes with the protocol's retries and rings the batcher
        (shms_push_request); check_lease() raises if the lease ended."""
        return self.ops.push_request(self.offset, self.capacity, owner, slot, generation,
                                     check_lease)


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
