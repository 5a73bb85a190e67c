"""The client's arena allocator (shmserve.arena), no server involved."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmserve.client.arena import ArenaAllocator, ArenaFull
from shmserve.protocol import DATA_ALIGN

BEGIN = 8192


def test_alignment_and_first_fit():
    a = ArenaAllocator(BEGIN, BEGIN + 4096)
    x = a.alloc(1)
    y = a.alloc(65)
    z = a.alloc(0)
    assert (x, y, z) == (BEGIN, BEGIN + 64, BEGIN + 192)
    assert a.used == 64 + 128 + 64
    a.free(y, 65)
    assert a.alloc(100) == y  # first fit reuses the hole
    assert a.alloc(100) == BEGIN + 256  # too big for what is left of it: goes after


def test_full_and_exact_fit():
    a = ArenaAllocator(BEGIN, BEGIN + 1024)
    blocks = [a.alloc(256) for _ in range(4)]
    assert a.used == a.capacity == 1024
    with pytest.raises(ArenaFull):
        a.alloc(1)
    a.free(blocks[1], 256)
    with pytest.raises(ArenaFull):
        a.alloc(257)  # 256 free, but not more
    assert a.alloc(256) == blocks[1]


@pytest.mark.parametrize("order", ["forward", "backward", "middle-out", "shuffled"])
def test_free_coalesces_back_to_one_block(order):
    a = ArenaAllocator(BEGIN, BEGIN + 64 * 100)
    blocks = [a.alloc(64 * (1 + i % 3)) for i in range(50)]
    sizes = {b: 64 * (1 + i % 3) for i, b in enumerate(blocks)}
    if order == "backward":
        blocks.reverse()
    elif order == "middle-out":
        blocks = blocks[25:] + blocks[:25][::-1]
    elif order == "shuffled":
        random.Random(0).shuffle(blocks)
    for b in blocks:
        a.free(b, sizes[b])
    assert a.used == 0
    assert a.alloc(a.capacity) == BEGIN  # one free block spanning everything again


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=120))
def test_random_alloc_free_never_overlaps(ops):
    a = ArenaAllocator(BEGIN, BEGIN + 16384)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            try:
                off = a.alloc(n)
            except ArenaFull:
                continue
            size = max(DATA_ALIGN, -(-n // DATA_ALIGN) * DATA_ALIGN)
            assert off % DATA_ALIGN == 0 and BEGIN <= off and off + size <= a.end
            for o, s in live.items():
                assert off + size <= o or o + s <= off, "overlapping blocks"
            live[off] = size
        else:
            off = sorted(live)[n % len(live)]
            a.free(off, live.pop(off))
        assert a.used == sum(live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.alloc(a.capacity) == BEGIN


def test_threads():
    a = ArenaAllocator(BEGIN, BEGIN + 64 * 64)
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors = []

    def work(t):
        rng = random.Random(t)
        for _ in range(2000):
            n = rng.randrange(1, 200)
            try:
                off = a.alloc(n)
            except ArenaFull:
                continue
            with lock:
                if off in owners:
                    errors.append(off)
                owners[off] = t
            with lock:
                del owners[off]
            a.free(off, n)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert a.used == 0 and a.alloc(a.capacity) == BEGIN
