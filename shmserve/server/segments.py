"""Creating and removing the server's segments (the coordinator's alone), their
layouts, the server record, and group access to the runtime directory."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import os
import secrets
import struct
from pathlib import Path

import posix_ipc

from ..errors import ShmSpaceError
from ..protocol import LAYOUT, SLOT_BYTES
from ..segments import SIZE_SEALS, Segment, runtime_dir, unlink_quietly

SHM_DIR = Path("/dev/shm")
PREFIX = "shmserve"


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


def resolve_group(group: str) -> int:
    """The gid of `serve --group` (a name or a number), or ValueError naming it."""
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise ValueError(f"--group {group!r}: no such group") from None


def share_with_group(path: Path, gid: int, mode: int) -> None:
    """Gives `gid` access to a file this server created (the socket,
    runtime directory). The server's user must belong to that group (or be root)."""
    try:
        os.chown(path, -1, gid)
        os.chmod(path, mode)
    except PermissionError:
        raise PermissionError(f"cannot give group {gid} access to {path}: the server's user "
                              "must be a member of that group") from None


def unreachable_by_group(path: Path, gid: int) -> Path | None:
    """The first ancestor of path that members of gid cannot traverse, if any."""
    for parent in path.parents:
        st = parent.stat()
        if not (st.st_mode & 0o001 or (st.st_mode & 0o010 and st.st_gid == gid)):
            return parent
    return None


def record_path(name: str) -> Path:
    return runtime_dir() / f"{name}.json"


def new_prefix() -> str:
    """Segment names carry an unguessable token so two servers never collide."""
    return f"/{PREFIX}-{os.getuid()}-{secrets.token_hex(8)}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_named(name: str, size: int, what: str, mode: int = 0o600) -> Segment:
    """A new named POSIX segment (the server-private one), every page reserved."""
    mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode)
    try:
        _reserve(mem.fd, size, what)
    except BaseException:
        os.close(mem.fd)
        posix_ipc.unlink_shared_memory(name)
        raise
    os.close(mem.fd)
    return Segment(name, size)


def create_sealed(name: str, size: int, what: str) -> Segment:
    """A new anonymous segment (memfd) whose size is sealed: nobody, its clients
    included, can shrink or grow it (a shrunk segment makes every mapping's next
    access a SIGBUS). It has no name anyone could open; it travels as the file
    descriptor `fd`, which stays open until close(). The control segment and the
    arenas are made so."""
    avail = mem_available_bytes()
    if size > avail:
        raise ShmSpaceError(_no_space(what, size, avail))
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _reserve(fd, size, what)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        seg = Segment.from_fd(fd, size, name)
    except BaseException:
        os.close(fd)
        raise
    seg.fd = fd
    return seg


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo: what a new arena (a memfd, outside /dev/shm) may take."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _no_space(what: str, size: int, free: int, where: str = "memory") -> str:
    hint = (f"enlarge it (docker run --shm-size=1g, or mount -o remount,size=1G {SHM_DIR}) "
            if where == str(SHM_DIR) else "")
    return (f"not enough space in {where} for the {what} ({size / 2**20:.1f} MiB needed, "
            f"{free / 2**20:.1f} MiB free); {hint}or ask for less")


def _reserve(fd: int, size: int, what: str) -> None:
    """Allocate every page now: running out of shared memory later would be a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        if os.fstat(fd).st_dev == os.stat(SHM_DIR).st_dev:
            raise ShmSpaceError(_no_space(what, size, shm_free_bytes(), str(SHM_DIR))) from None
        raise ShmSpaceError(_no_space(what, size, mem_available_bytes())) from None


# ---------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class ServerLayout:
    """Offsets in the server-private segment (shms_server_header)."""

    max_clients: int
    slots_per_client: int
    n_models: int
    n_workers: int

    @functools.cached_property
    def clients_offset(self) -> int:
        return _align(LAYOUT["server.size"], 64)

    @functools.cached_property
    def models_offset(self) -> int:
        return _align(self.clients_offset + self.max_clients * LAYOUT["client_entry.size"], 64)

    @functools.cached_property
    def shadows_offset(self) -> int:
        return _align(self.models_offset + max(self.n_models, 1) * LAYOUT["model.size"], 64)

    @functools.cached_property
    def mailboxes_offset(self) -> int:
        n = self.max_clients * self.slots_per_client
        return _align(self.shadows_offset + n * LAYOUT["shadow.size"], 64)

    @property
    def size(self) -> int:
        return _align(self.mailboxes_offset + max(self.n_workers, 1) * LAYOUT["mailbox.size"])

    def client(self, client_id: int) -> int:
        return self.clients_offset + client_id * LAYOUT["client_entry.size"]

    def model(self, model_id: int) -> int:
        return self.models_offset + model_id * LAYOUT["model.size"]

    def shadow(self, client_id: int, slot: int) -> int:
        index = client_id * self.slots_per_client + slot
        return self.shadows_offset + index * LAYOUT["shadow.size"]

    def shadow_index(self, client_id: int, slot: int) -> int:
        return client_id * self.slots_per_client + slot

    def shadow_at(self, index: int) -> int:
        return self.shadows_offset + index * LAYOUT["shadow.size"]

    def mailbox(self, worker: int) -> int:
        return self.mailboxes_offset + worker * LAYOUT["mailbox.size"]


def control_size(ring_capacity: int) -> int:
    return _align(LAYOUT["control.size"] + ring_capacity * LAYOUT["ring_cell.size"])


def control_ring_offset() -> int:
    return LAYOUT["control.size"]


def init_control(buf, ops, ring_capacity: int, server_pid: int) -> None:
    """Writes a fresh control block and ring into `buf` (a zeroed segment)."""
    if ring_capacity < 2 or ring_capacity & (ring_capacity - 1):
        raise ValueError(f"ring capacity {ring_capacity} must be a power of two >= 2")
    struct.pack_into("<QIIIII", buf, 0, LAYOUT["MAGIC_CONTROL"], LAYOUT["PROTOCOL_VERSION"],
                     LAYOUT["control.size"], control_ring_offset(), ring_capacity, server_pid)
    struct.pack_into("<Q", buf, LAYOUT["control.segment_bytes"], len(buf))
    for i in range(ring_capacity):  # Vyukov: cell i starts free for position i
        ops.store64(control_ring_offset() + i * LAYOUT["ring_cell.size"], i)


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Offsets in one client's arena segment (shms_arena_header)."""

    n_slots: int
    segment_bytes: int

    @functools.cached_property
    def slots_offset(self) -> int:
        return _align(LAYOUT["arena.size"], 64)

    @functools.cached_property
    def data_offset(self) -> int:
        return _align(self.slots_offset + self.n_slots * SLOT_BYTES, 4096)

    def slot(self, index: int) -> int:
        return self.slots_offset + index * SLOT_BYTES

    @classmethod
    def for_data(cls, n_slots: int, data_bytes: int) -> "ArenaLayout":
        probe = cls(n_slots, 0)
        return cls(n_slots, _align(probe.data_offset + data_bytes))


# ---------------------------------------------------------------- server records

def write_record(name: str, record: dict) -> None:
    path = record_path(name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def read_record(name: str) -> dict | None:
    try:
        return json.loads(record_path(name).read_text())
    except (OSError, ValueError):
        return None


def remove_segments(prefix: str) -> list[str]:
    """Unlinks every segment whose name starts with `prefix` (a dead server's)."""
    removed = []
    base = prefix.lstrip("/")
    for entry in SHM_DIR.glob(base + "-*"):
        unlink_quietly("/" + entry.name)
        removed.append(entry.name)
    return removed
