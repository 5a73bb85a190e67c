"""Mapping shared-memory segments, and where a server's files live: what every
process role needs, clients included. Creating segments is the coordinator's alone
(shmserve/server/segments.py).

Every segment is a sealed memfd with no name in /dev/shm: the control segment and
each client's arena are handed over as file descriptors, the server-private segment
is inherited by the batcher and the workers.
"""
from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

from . import _core

DEFAULT_NAME = "default"

# A shared segment's size can never change: a peer that shrank it under us would make
# our next access to it a SIGBUS. Memfds are mapped only with these seals set.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def runtime_dir(create: bool = True) -> Path:
    """Per-user directory (0700) holding control sockets and server records. A client
    only looks (create=False): with `serve --group`, SHMSERVE_RUNTIME_DIR may name the
    directory of a server of another user."""
    base = os.environ.get("SHMSERVE_RUNTIME_DIR")
    if base:
        path = Path(base)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "shmserve"
    else:
        path = Path(f"/tmp/shmserve-{os.getuid()}")
    if not create:
        return path
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    # Group access (0710) is granted only by `serve --group`; others never get any.
    if st.st_uid != os.getuid() or st.st_mode & 0o067:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700 "
                              "(0710 when a server shares it with a group)")
    return path


def socket_path(name: str, create: bool = True) -> Path:
    return runtime_dir(create) / f"{name}.sock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """A mapped sealed memfd with its protocol operations (`ops`, the C core's
    Mapping), made by from_fd or open_path. `fd` is the descriptor this object owns
    (a segment the coordinator created), else None."""

    @classmethod
    def from_fd(cls, fd: int, size: int, name: str, readonly: bool = False) -> "Segment":
        """Maps size bytes of an open descriptor (which the caller keeps or closes),
        read-only if told (a client's control block: its descriptor is O_RDONLY).
        Refuses a file that is shorter, or whose size is not sealed (a peer could
        shrink it under us)."""
        st = os.fstat(fd)
        if st.st_size < size:
            raise ValueError(f"segment {name} holds {st.st_size} bytes, expected {size}")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
            raise ValueError(f"segment {name} is not sealed against resizing")
        seg = cls.__new__(cls)
        seg._map(name, fd, size, readonly)
        seg.fd = None
        return seg

    @classmethod
    def open_path(cls, path: str, size: int) -> "Segment":
        """Maps a sealed segment through a path to its descriptor: the batcher and the
        workers open the coordinator's memfds as /proc/<coordinator pid>/fd/<n>."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            return cls.from_fd(fd, size, path)
        finally:
            os.close(fd)

    def _map(self, name: str, fd: int, size: int, readonly: bool = False) -> None:
        self.name = name
        self.size = size
        self.mmap = mmap.mmap(fd, size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_DEFAULT)
        self.ops = _core.Mapping(self.mmap)
        self.buffer = memoryview(self.mmap)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.ops is None:
            return
        self.ops.release()
        self.buffer.release()
        self.ops = None
        try:
            self.mmap.close()
        except BufferError:
            # numpy views of this segment are still alive; the mapping stays until
            # they go (a memfd has no name: it goes with its last descriptor and mapping).
            pass
