"""The client's allocator for its arena: first fit over a sorted free list, with
coalescing. Blocks are DATA_ALIGN-aligned offsets into the arena segment. Only the
owning client allocates; the server only reads and writes the blocks it is given."""
from __future__ import annotations

import bisect
import threading

from ..protocol import DATA_ALIGN


class ArenaFull(Exception):
    pass


class ArenaAllocator:
    def __init__(self, begin: int, end: int):
        self.begin, self.end = begin, end
        self._starts = [begin]  # free blocks, sorted by start
        self._sizes = {begin: end - begin}
        self._lock = threading.Lock()
        self.used = 0

    @property
    def capacity(self) -> int:
        return self.end - self.begin

    def alloc(self, nbytes: int) -> int:
        size = max(DATA_ALIGN, (nbytes + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN)
        with self._lock:
            for i, start in enumerate(self._starts):
                free = self._sizes[start]
                if free < size:
                    continue
                del self._sizes[start]
                if free == size:
                    del self._starts[i]
                else:
                    self._starts[i] = start + size
                    self._sizes[start + size] = free - size
                self.used += size
                return start
        raise ArenaFull(f"no free block of {size} bytes ({self.capacity - self.used} bytes free "
                        "in pieces)")

    def free(self, offset: int, nbytes: int) -> None:
        size = max(DATA_ALIGN, (nbytes + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN)
        with self._lock:
            self.used -= size
            i = bisect.bisect_left(self._starts, offset)
            # merge with the next free block
            if i < len(self._starts) and self._starts[i] == offset + size:
                size += self._sizes.pop(self._starts[i])
                del self._starts[i]
            # merge with the previous free block
            if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
                self._sizes[self._starts[i - 1]] += size
                return
            self._starts.insert(i, offset)
            self._sizes[offset] = size
