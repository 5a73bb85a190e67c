"""Triton's system shared memory extension on a front's side, for every network front
(HTTP here, gRPC alike): register / status / unregister go to the coordinator's one
registry (server/system_shm.py, where the design is described); infer inputs are read
from a region and outputs written into one, through this process's own mappings.

    shm = SystemSharedMemory(client)            # one per front process
    shm.register(name, key, offset, byte_size)  # blocking control calls: run them in a
    shm.status(name=None); shm.unregister(name=None)   # thread from an event loop
    if shm.needs_refresh():                     # cheap: reads the registry's generation
        shm.refresh()                           # blocking: the table, when it changed
    array = shm.read_input(region, offset, byte_size, ...)   # one copy, into the arena
    target = shm.output_target(region, offset, byte_size)   # checked before the request
    nbytes = shm.write_output(target, name, array, datatype) # one copy, into the region

Errors are ShmServeError with Triton's words and a status a front maps to its own codes
(INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT, NOT_FOUND: 404 / NOT_FOUND).

Copies: an input region's bytes are copied once, into an array of the front's arena
(which the workers read in place); an output is copied once, from the answer's view of
the arena into the region. A mapping dropped from the table (unregistered) is unmapped
when the last request using it lets go of its views.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import threading

import numpy as np

from .. import protocol as P
from ..errors import ShmServeError
from ..segments import Segment

REFRESH_TRIES = 5  # a table whose descriptors changed under us is asked for again


def _invalid(msg: str) -> ShmServeError:
    return ShmServeError(msg, P.Status.INVALID_ARG)


class Region:
    """This front's mapping of one registered region (made when the table is adopted)."""

    __slots__ = ("name", "key", "offset", "byte_size", "dev", "ino", "mm", "base", "error")

    def __init__(self, row: dict):
        self.name, self.key = row["name"], row["key"]
        self.offset, self.byte_size = row["offset"], row["byte_size"]
        self.dev, self.ino = row["dev"], row["ino"]
        self.mm, self.base, self.error = None, 0, None

    def same(self, row: dict) -> bool:
        return (self.key, self.offset, self.byte_size, self.dev, self.ino) == (
            row["key"], row["offset"], row["byte_size"], row["dev"], row["ino"])

    def map(self, path: str) -> bool:
        """Maps the region through the coordinator's descriptor. False when that
        descriptor is no longer the registered file (the table is stale)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False  # unregistered since the table was read
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self.dev, self.ino):
                return False
            # mmap offsets are page-aligned: map from the page holding the region's start
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
            self.base = self.offset - start
            try:
                self.mm = mmap.mmap(fd, self.base + self.byte_size, offset=start)
            except (ValueError, OSError) as e:  # shrunk below the region since registered
                self.error = (f"shared memory region '{self.name}' cannot be mapped: its object "
                              f"'{self.key}' holds {st.st_size} bytes, the region needs "
                              f"{self.offset + self.byte_size} ({e})")
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        return True

    def view(self, offset: int, byte_size: int) -> memoryview:
        """The bytes [offset, offset + byte_size) of the region (bounds checked by the
        caller). The object's size is checked on every use: touching a page past the
        end of a file shrunk by its owner would kill this process (SIGBUS)."""
        if self.error:
            raise _invalid(self.error)
        size = self.mm.size()  # fstat of the mapped file
        if size < self.offset + self.byte_size:
            raise _invalid(f"shared memory region '{self.name}': its object '{self.key}' now "
                           f"holds {size} bytes, fewer than the {self.offset + self.byte_size} "
                           "it was registered with")
        start = self.base + offset
        return memoryview(self.mm)[start:start + byte_size]


@dataclasses.dataclass
class OutputTarget:
    region: Region
    offset: int
    byte_size: int


class SystemSharedMemory:
    def __init__(self, client):
        self.client = client
        self._regions: dict[str, Region] = {}  # replaced whole, never changed in place
        self._generation = -1
        self._page: Segment | None = None
        self._lock = threading.Lock()  # refreshes come from executor threads

    # -- the control requests (blocking) --------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not (0 <= offset < 1 << 63 and 0 <= byte_size < 1 << 63):  # the control frame's ints
            raise _invalid(f"failed to register shared memory region '{name}': invalid args "
                           f"(offset {offset} and byte_size {byte_size} must be in [0, 2^63))")
        self._adopt(self.client.engine.call(P.ShmRegister(name, key, offset, byte_size)))

    def status(self, name: str | None = None) -> list[dict]:
        """Triton's status rows: name, key, offset, byte_size."""
        reply = self.client.engine.call(P.ShmStatus(name))
        if name is None:
            self._adopt(reply)
        return [{k: r[k] for k in ("name", "key", "offset", "byte_size")} for r in reply.regions]

    def unregister(self, name: str | None = None) -> None:
        self._adopt(self.client.engine.call(P.ShmUnregister(name)))

    # -- the table -----------------------------------------------------------------
    def needs_refresh(self) -> bool:
        """Whether a registration or unregistration happened since the table was read."""
        # SYNC POINT: pairs with the coordinator's store64 in SystemShmRegistry.bump.
        return self._page is None or self._page.ops.load64(0) != self._generation

    def refresh(self) -> None:
        for _ in range(REFRESH_TRIES):
            if self._adopt(self.client.engine.call(P.ShmStatus(None))):
                return
        raise ShmServeError("the system shared memory regions kept changing while this front "
                            "read them; retry the request", P.Status.UNAVAILABLE)

    def _adopt(self, reply: P.ShmRegions) -> bool:
        """Makes a full table of the coordinator's this process's: keeps the mappings of
        unchanged regions, maps new ones. False if a region's descriptor was not the
        registered file any more (the caller asks again)."""
        with self._lock:
            if self._page is None:
                self._page = Segment.open_path(reply.generation_path, 8)
            if reply.generation < self._generation:
                return True  # an older answer than the table held (threads crossed)
            regions = {}
            for row in reply.regions:
                old = self._regions.get(row["name"])
                if old is not None and old.same(row):
                    regions[row["name"]] = old
                    continue
                region = Region(row)
                if not region.map(row["path"]):
                    return False
                regions[row["name"]] = region
            self._regions, self._generation = regions, reply.generation
            return True

    def _find(self, name: str, offset: int, byte_size: int) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise ShmServeError(f"Unable to find shared memory region: '{name}'",
                                P.Status.NOT_FOUND)
        if offset >= region.byte_size:
            raise _invalid(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > region.byte_size:
            raise _invalid(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region

    # -- tensors ---------------------------------------------------------------------
    def read_input(self, region: str, offset: int, byte_size: int, *, name: str,
                   datatype: str, dtype: np.dtype, shape, model: str, empty) -> np.ndarray:
        """Input `name` from the region: fixed-size types copied into an array of the
        arena (`empty(shape, dtype)`), BYTES parsed (4-byte lengths, then the bytes)."""
        r = self._find(region, offset, byte_size)
        view = r.view(offset, byte_size)
        try:
            if datatype == "BYTES":
                try:
                    return P.decode_bytes(view, shape)
                except ValueError as e:
                    raise _invalid(f"input '{name}' for model '{model}' in shared memory "
                                   f"region '{region}': {e}") from None
            expected = math.prod(shape) * dtype.itemsize
            if byte_size != expected:
                raise _invalid(f"input byte size mismatch for input '{name}' for model "
                               f"'{model}'. Expected {expected}, got {byte_size}")
            arr = empty(shape, dtype) if expected else np.empty(shape, dtype)
            arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(view, np.uint8)  # the one copy
            return arr
        finally:
            view.release()

    def output_target(self, region: str, offset: int, byte_size: int) -> OutputTarget:
        """Where an output goes, checked before the request runs (as Triton does)."""
        return OutputTarget(self._find(region, offset, byte_size), offset, byte_size)

    def write_output(self, target: OutputTarget, name: str, array: np.ndarray,
                     datatype: str) -> int:
        """Writes output `name` into its region; returns the bytes written."""
        if datatype == "BYTES":
            data = np.frombuffer(P.encode_bytes(array), np.uint8)
        else:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if data.nbytes > target.byte_size:
            raise _invalid(f"shared memory size specified with the request for output '{name}' "
                           f"({target.byte_size} bytes) should be at least {data.nbytes} bytes "
                           "to hold the results")
        view = target.region.view(target.offset, data.nbytes)
        try:
            np.frombuffer(view, np.uint8)[:] = data  # the one copy
        finally:
            view.release()
        return data.nbytes
