"""The process table from /proc, in one place: the benchmark's server-CPU figures
(cost.py), the soak runner and the tests all look at a server's process tree
through it."""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    state: str  # "R", "S", "Z", ...
    ppid: int
    pgrp: int
    cpu_ticks: int  # utime + stime


def processes() -> dict[int, Proc]:
    """Every process readable now (ones that vanish while we look are skipped)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2:].split()  # comm may hold spaces: fields after ')'
        table[int(entry)] = Proc(int(entry), rest[0], int(rest[1]), int(rest[2]),
                                 int(rest[11]) + int(rest[12]))
    return table


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) children of a process."""
    return sorted(p.pid for p in processes().values() if p.ppid == pid and p.state != "Z")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    return sorted(p.pid for p in processes().values() if p.pgrp == pgid and p.state != "Z")


def descendants(pid: int, table: dict[int, Proc] | None = None) -> set[int]:
    """A process and everything below it."""
    table = processes() if table is None else table
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for p in table.values():
            if p.ppid == parent and p.pid not in found:
                found.add(p.pid)
                frontier.append(p.pid)
    return found


def cmdline(pid: int) -> list[str]:
    """A process's argv ([] if it is gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def open_memfds(pid: int, label: str) -> list[str]:
    """The memfds whose label starts with `label` that process pid holds open, each
    once (Python's mmap keeps a second descriptor of what it maps): a coordinator's
    arenas are "shmserve-arena-", one per live lease."""
    found = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:" + label):
            found.add(target)
    return sorted(found)


def shm_files(pids) -> list[str]:
    """The /dev/shm entries these processes hold open or have mapped, each once."""
    found = set()
    for pid in pids:
        try:
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                targets += [line.split(maxsplit=5)[-1].strip() for line in f]
        except OSError:  # it exited meanwhile, or a descriptor closed
            continue
        found.update(t.removesuffix(" (deleted)").removeprefix("/dev/shm/")
                     for t in targets if t.startswith("/dev/shm/"))
    return sorted(found)
