"""The client's allocator for its arena: first fit over a sorted free list, with
coalescing. Blocks are DATA_ALIGN-aligned offsets into the arena segment. Only the
owning client allocates; the server only reads and writes the blocks it is given.

It is the C core's (csrc/arena.c), so that the C path of a request (csrc/client.c)
and the Python path (engine.py) share one allocator; the GIL is its lock.

    ArenaAllocator(begin, end): alloc(nbytes) -> offset (raises ArenaFull),
    free(offset, nbytes), begin, end, capacity, used (bytes in allocated blocks)
"""
from .._core import ArenaAllocator, ArenaFull

__all__ = ["ArenaAllocator", "ArenaFull"]
