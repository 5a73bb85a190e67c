"""This process's view of a client's submission ring (shms_ring in csrc/shmserve.h),
in that client's arena."""
from __future__ import annotations

from .layout import PopResult

# shms_pop_result; EMPTY comes back as None
POP_OK, POP_STALLED, POP_CORRUPT = PopResult.OK, PopResult.STALLED, PopResult.CORRUPT


class Ring:
    """A client's view of its ring: offset and capacity are checked once, at attach,
    and never re-read from the client-writable arena header (shms_ring_attach)."""

    def __init__(self, arena_ops):
        self.ops = arena_ops
        self.offset, self.capacity = arena_ops.ring_attach()

    def push(self, owner: int, slot: int, generation: int) -> int:
        """One push attempt (tests and tools); clients use push_request."""
        return self.ops.ring_push(self.offset, self.capacity, owner, slot, generation)

    def push_request(self, control_ops, bell_ops, owner: int, slot: int, generation: int,
                     check_lease) -> int:
        """Pushes with the protocol's retries and rings the batcher
        (shms_push_request); check_lease() raises if the lease ended."""
        return self.ops.push_request(self.offset, self.capacity, control_ops, bell_ops, owner,
                                     slot, generation, check_lease)


class RingConsumer:
    """The batcher's side of one client's ring: offset and capacity are the server's
    own geometry (ArenaLayout), and `pos`, the next position to take, lives in the
    server-private client table (client_entry.ring_pos), out of the client's reach."""

    def __init__(self, arena_ops, offset: int, capacity: int, srv_ops, pos_off: int):
        self.ops, self.offset, self.capacity = arena_ops, offset, capacity
        self.srv, self.pos_off = srv_ops, pos_off

    @property
    def pos(self) -> int:
        return self.srv.load64(self.pos_off)

    @pos.setter
    def pos(self, value: int) -> None:
        self.srv.store64(self.pos_off, value)

    def pop(self):
        """None (empty), or (POP_OK, client, slot, generation), (POP_STALLED, owner,
        head_seq, 0), (POP_CORRUPT, 0, head_seq, 0)."""
        pos = self.pos
        got = self.ops.ring_pop(self.offset, self.capacity, pos)
        if got is not None and got[0] == POP_OK:
            self.pos = pos + 1
        return got

    def skip(self, head_seq: int) -> bool:
        pos = self.pos
        if self.ops.ring_skip(self.offset, self.capacity, pos, head_seq):
            self.pos = pos + 1
            return True
        return False

    def repair(self) -> bool:
        return self.ops.ring_repair(self.offset, self.capacity, self.pos)

    def pending(self) -> list[tuple[int, int, int]]:
        return self.ops.ring_pending(self.offset, self.capacity, self.pos)
