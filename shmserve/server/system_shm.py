"""The registry of Triton's system shared memory extension (the coordinator's):
regions callers register through any network front (HTTP, gRPC), visible to every
front process.

Where it lives and why: the fronts are several processes (--http-thread-count, the
gRPC front), and a region registered through one connection must serve a request that
lands on another. The coordinator holds the one registry and answers the control
requests ShmRegister / ShmStatus / ShmUnregister (protocol/control.py). At registration
it opens the object (shm_open semantics: /dev/shm/<key>, O_RDWR, no symlink), checks
the bounds against the file, and keeps the descriptor open: a front maps the region
through /proc/<coordinator>/fd/<n>, so every front maps the very file registered even if
the caller unlinks or replaces the name afterwards (Triton keeps its mapping the same way).
The coordinator never maps a region and never reads a byte of it.

Fronts cache their mappings by the registry's generation, a u64 in a one-page sealed
memfd (`generation_path`) that every registration and unregistration bumps: a front
reads it before it uses a region, and asks for the table again only when it changed
(shmserve/front/shm.py). Unregistering closes the coordinator's descriptor; each front
drops its mapping at its next look at the generation (after the requests that use it).
"""
from __future__ import annotations

import logging
import os
import stat

import posix_ipc

from .. import protocol as P
from ..errors import ShmServeError
from ..segments import Segment
from .segments import PREFIX, create_sealed

log = logging.getLogger("shmserve.coordinator")
MAX_REGIONS = 1024  # each holds a descriptor of the coordinator's
GENERATION_BYTES = 4096
# Keys of the server's own segments: never registrable (they would expose its tables).
RESERVED_KEY_PREFIX = PREFIX + "-"


def _invalid(msg: str) -> ShmServeError:
    return ShmServeError(msg, P.Status.INVALID_ARG)


class SystemShmRegistry:
    def __init__(self):
        self.regions: dict[str, dict] = {}  # name -> {key, offset, byte_size, fd, dev, ino}
        self.generation = 0
        self._page: Segment | None = None  # made at the first request

    # -- the control requests ----------------------------------------------------
    def handle(self, msg: P.Message) -> P.ShmRegions:
        if isinstance(msg, P.ShmRegister):
            self.register(msg.name, msg.key, msg.offset, msg.byte_size)
            return self.reply(None)  # the whole table: the front that asked adopts it
        if isinstance(msg, P.ShmUnregister):
            self.unregister(msg.name)
            return self.reply(None)
        return self.reply(msg.name)

    def reply(self, name: str | None) -> P.ShmRegions:
        if name is not None and name not in self.regions:
            raise ShmServeError(f"Unable to find system shared memory region: '{name}'",
                                P.Status.NOT_FOUND)
        names = sorted(self.regions) if name is None else [name]
        pid = os.getpid()
        rows = [{"name": n, "key": r["key"], "offset": r["offset"], "byte_size": r["byte_size"],
                 "path": f"/proc/{pid}/fd/{r['fd']}", "dev": r["dev"], "ino": r["ino"]}
                for n in names for r in (self.regions[n],)]
        page = self.page()
        return P.ShmRegions(rows, self.generation, f"/proc/{pid}/fd/{page.fd}")

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise _invalid("'region name' is necessary to register system shared memory region")
        if name in self.regions:
            raise _invalid(f"shared memory region '{name}' already in manager")
        if offset < 0 or byte_size < 0:
            raise _invalid(f"failed to register shared memory region '{name}': invalid args "
                           "(offset and byte_size must be non-negative)")
        if key.lstrip("/").startswith(RESERVED_KEY_PREFIX):
            raise _invalid(f"cannot register shared memory region '{name}' with key '{key}' as "
                           f"the key contains the reserved prefix '{RESERVED_KEY_PREFIX}'")
        if len(self.regions) >= MAX_REGIONS:
            raise _invalid(f"failed to register shared memory region '{name}': {MAX_REGIONS} "
                           "regions are registered already (unregister some first)")
        fd = _open_object(key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _invalid(f"Unable to open shared memory region: '{key}' "
                               "(not a shared memory object)")
            if byte_size == 0 or offset + byte_size > st.st_size:
                raise _invalid(f"failed to register shared memory region '{name}': invalid args "
                               f"(offset {offset} + byte_size {byte_size} must be within the "
                               f"{st.st_size} bytes of '{key}', byte_size at least 1)")
        except BaseException:
            os.close(fd)
            raise
        self.regions[name] = {"key": key, "offset": offset, "byte_size": byte_size, "fd": fd,
                              "dev": st.st_dev, "ino": st.st_ino}
        self.bump()
        log.info("system shared memory region registered: '%s' (key '%s', offset %d, "
                 "%d bytes)", name, key, offset, byte_size)

    def unregister(self, name: str | None) -> None:
        names = list(self.regions) if name is None else [name] if name in self.regions else []
        for n in names:
            os.close(self.regions.pop(n)["fd"])
            log.info("system shared memory region unregistered: '%s'", n)
        if names:
            self.bump()

    # -- the generation page -------------------------------------------------------
    def page(self) -> Segment:
        if self._page is None:
            self._page = create_sealed("shmserve-shm-registry", GENERATION_BYTES,
                                       what="system shared memory registry page")
            self._page.ops.store64(0, self.generation)
        return self._page

    def bump(self) -> None:
        self.generation += 1
        # SYNC POINT: pairs with the fronts' load64 in front/shm.py (SystemSharedMemory.fresh):
        # the table they then ask for is at least this new.
        self.page().ops.store64(0, self.generation)

    def close(self) -> None:
        self.unregister(None)
        if self._page is not None:
            self._page.close()
            self._page = None


def _open_object(key: str) -> int:
    """A read/write descriptor of the POSIX shared memory object `key`, opened as
    Triton does (shm_open, which follows no symlink and takes no '/' past the first)."""
    try:
        mem = posix_ipc.SharedMemory(key, read_only=False)
    except (posix_ipc.Error, ValueError, OSError) as e:
        raise _invalid(f"Unable to open shared memory region: '{key}' ({e})") from None
    return mem.fd
