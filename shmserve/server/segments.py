"""Creating and removing the server's segments (the coordinator's alone), their
layouts, the server record, and group access to the runtime directory."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import os
from pathlib import Path

from .. import _core
from ..errors import ShmSpaceError
from ..protocol import LAYOUT, SLOT_BYTES
from ..segments import SIZE_SEALS, Segment, runtime_dir

SHM_DIR = Path("/dev/shm")  # where a server puts nothing of its own (system_shm.py maps users')
PREFIX = "shmserve"  # memfd labels; /dev/shm keys of this prefix are refused (system_shm.py)


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


def create_sealed(name: str, size: int, what: str) -> Segment:
    """A new anonymous segment (memfd) whose size is sealed: nobody, its clients
    included, can shrink or grow it (a shrunk segment makes every mapping's next
    access a SIGBUS). It has no name anyone could open; it travels as the file
    descriptor `fd`, which stays open until close(). Every segment of the server is
    made so: the control segment, the server-private segment and the arenas."""
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
    """MemAvailable of /proc/meminfo: what a new segment (a memfd, outside /dev/shm and
    its size limit) may take."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _no_space(what: str, size: int, free: int) -> str:
    return (f"not enough space in memory for the {what} ({size / 2**20:.1f} MiB needed, "
            f"{free / 2**20:.1f} MiB free); or ask for less")


def _reserve(fd: int, size: int, what: str) -> None:
    """Allocate every page now: running out of shared memory later would be a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        raise ShmSpaceError(_no_space(what, size, mem_available_bytes())) from None


# ---------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class ServerLayout:
    """Offsets in the server-private segment, as the C core lays it out
    (shms_server_init)."""

    max_clients: int
    slots_per_client: int
    n_models: int
    n_workers: int

    @functools.cached_property
    def _offsets(self) -> dict:
        return _core.server_layout(self.max_clients, self.slots_per_client, self.n_models,
                                   self.n_workers)

    @property
    def clients_offset(self) -> int:
        return self._offsets["clients_offset"]

    @property
    def models_offset(self) -> int:
        return self._offsets["models_offset"]

    @property
    def shadows_offset(self) -> int:
        return self._offsets["shadows_offset"]

    @property
    def mailboxes_offset(self) -> int:
        return self._offsets["mailboxes_offset"]

    @property
    def size(self) -> int:
        return self._offsets["segment_bytes"]

    def client(self, client_id: int) -> int:
        return self.clients_offset + client_id * LAYOUT["client_entry.size"]

    def model(self, model_id: int) -> int:
        return self.models_offset + model_id * LAYOUT["model.size"]

    def shadow(self, client_id: int, slot: int) -> int:
        return self.shadow_at(self.shadow_index(client_id, slot))

    def shadow_index(self, client_id: int, slot: int) -> int:
        return client_id * self.slots_per_client + slot

    def shadow_at(self, index: int) -> int:
        return self.shadows_offset + index * LAYOUT["shadow.size"]

    def mailbox(self, worker: int) -> int:
        return self.mailboxes_offset + worker * LAYOUT["mailbox.size"]


def control_size() -> int:
    return _core.control_bytes()


def bell_size() -> int:
    return _core.bell_bytes()


def init_control(ops, server_pid: int) -> None:
    """Writes a fresh control block into a zeroed control segment."""
    ops.init_control(server_pid)


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Offsets in one client's arena segment, as the C core lays it out
    (shms_arena_layout)."""

    n_slots: int
    segment_bytes: int

    @functools.cached_property
    def _offsets(self) -> tuple[int, int, int, int, int]:
        return _core.arena_layout(self.n_slots, 0)

    @property
    def ring_offset(self) -> int:
        """The submission ring's first cell (enqueue_pos is in the header)."""
        return self._offsets[3]

    @property
    def ring_capacity(self) -> int:
        return self._offsets[4]

    @property
    def slots_offset(self) -> int:
        return self._offsets[0]

    @property
    def data_offset(self) -> int:
        return self._offsets[1]

    def slot(self, index: int) -> int:
        return self.slots_offset + index * SLOT_BYTES

    @classmethod
    def for_data(cls, n_slots: int, data_bytes: int) -> "ArenaLayout":
        return cls(n_slots, _core.arena_layout(n_slots, data_bytes)[2])


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

