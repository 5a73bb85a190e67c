"""Triton's response cache: `response_cache { enable: true }` in a model's config and
`--cache-config local,size=BYTES` on the server.

A request is the model's name and version, its inputs (name, data type, shape, data)
and, for a model that reads them, its parameters; its key is a 128-bit BLAKE2b digest
of those. A request whose key is held is answered with the outputs kept for it and
never executes; the others run as one batch, and each one's outputs are kept, least
recently used first out once the bytes held would pass the budget (an entry larger
than the whole budget is not kept, as Triton's local cache).

Where it lives: in each instance's worker (one cache per worker process, in its own
memory), with its share of the server's budget. What is hashed is the worker's
private copy of the inputs, and that same copy is what the model reads: a caller who
rewrites its arena during the execution cannot make one input's key name another
input's outputs. The outputs kept are copies of the model's (never the caller's
memory, which it may rewrite once answered).
"""
from __future__ import annotations

import collections
import hashlib
import json

import numpy as np

from ..errors import ConfigError

CACHE_FIELD = "response_cache"


def parse_cache_config(items: list[str]) -> int:
    """--cache-config NAME,KEY=VALUE (repeatable), as Triton takes it: the bytes of the
    `local` cache (0: no cache). Another cache (redis) or key is refused by name."""
    size = 0
    for item in items:
        name, sep, setting = item.partition(",")
        key, eq, value = setting.partition("=")
        if not sep or not eq:
            raise ConfigError(f"--cache-config {item!r}: expected NAME,KEY=VALUE "
                              "(e.g. local,size=1048576)")
        if name != "local":
            raise ConfigError(f"--cache-config {item!r}: the {name!r} cache is not implemented "
                              "by shmserve; only 'local' (size=BYTES) is")
        if key != "size":
            raise ConfigError(f"--cache-config {item!r}: the local cache takes size=BYTES "
                              f"only, not {key!r}")
        try:
            size = int(value)
        except ValueError:
            raise ConfigError(f"--cache-config {item!r}: size must be a whole number of "
                              "bytes") from None
        if size < 0:
            raise ConfigError(f"--cache-config {item!r}: size must not be negative")
    return size


def _nbytes(arr: np.ndarray) -> int:
    if arr.dtype == object:  # BYTES: the elements' own bytes
        return arr.nbytes + sum(len(x) for x in arr.flat if isinstance(x, (bytes, str)))
    return arr.nbytes


class ResponseCache:
    """One worker's cache: key -> the outputs of one request (its rows only)."""

    def __init__(self, capacity_bytes: int, model: str, version: int):
        self.capacity = capacity_bytes
        self.entries: collections.OrderedDict[bytes, tuple[dict, int]] = collections.OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.salt = f"{model}\0{version}\0".encode()

    def key(self, inputs: list[tuple[str, np.ndarray]], parameters: dict | None) -> bytes:
        """The digest of one request (inputs in the config's order)."""
        h = hashlib.blake2b(self.salt, digest_size=16)
        for name, arr in inputs:
            h.update(f"{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
            if arr.dtype == object:  # BYTES, parsed: each element length-prefixed
                for x in arr.flat:
                    b = x if isinstance(x, bytes) else str(x).encode()
                    h.update(len(b).to_bytes(8, "little"))
                    h.update(b)
            else:
                h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
        if parameters:
            h.update(json.dumps(parameters, sort_keys=True, default=str).encode())
        return h.digest()

    def get(self, key: bytes) -> dict | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, outputs: dict) -> bool:
        """Keeps outputs (arrays this cache owns) under key; False if too large to keep."""
        size = sum(_nbytes(a) for a in outputs.values())
        if size > self.capacity:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self.bytes + size > self.capacity:
            _, (_, freed) = self.entries.popitem(last=False)
            self.bytes -= freed
            self.evictions += 1
        self.entries[key] = (outputs, size)
        self.bytes += size
        return True

    def __len__(self) -> int:
        return len(self.entries)
