"""One way to run `shmserve serve` as a child process, for the tests, the benchmarks
and the soak runner:

    with ServerProcess(repo, log_path=tmp / "server.log") as server:   # started, ready
        client = server.client(arena_bytes=1 << 20)
        ...
    # stopped with SIGTERM; RuntimeError if a process was left, or it held a
    # /dev/shm segment of its own

or, to report rather than raise: `server.start()`, then `problems = server.teardown()`.

Each server gets a unique --name, a private runtime dir (socket and record) unless one
is given, its own session (process group), and SIGTERM (a clean shutdown, which
removes its segments) should the process that started it die without stopping it
(PR_SET_PDEATHSIG: that is the thread that called start(), so call it from a thread
that lives as long as the server should)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shmserve
from shmserve.server.segments import PREFIX

from .proctree import group_members, open_memfds, shm_files

ARENA_LABEL = "shmserve-arena-"  # a coordinator's arena memfds, one per live lease

_names = itertools.count()


def unique_name(prefix: str = "shms") -> str:
    """A server name no other server of this machine uses now: prefix, pid, counter."""
    return f"{prefix}{os.getpid()}-{next(_names)}"


def private_runtime_dir() -> Path:
    """A new 0700 directory with a short path (a socket path must fit in 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="shms-rt-", dir="/tmp"))


def poll_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    """True as soon as predicate() is true, False if it is still false after timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# Run as `python -S -c` ahead of a command: PR_SET_PDEATHSIG, then execv of the command
# (the setting survives execve). Arguments: signal, parent pid, the command. ctypes, not
# shmserve._core: importing shmserve (numpy) would add ~0.4 s to each start.
_PARENT_DEATH_LAUNCHER = """
import ctypes, os, sys
sig, parent = int(sys.argv[1]), int(sys.argv[2])
if ctypes.CDLL(None, use_errno=True).prctl(1, sig) != 0:  # PR_SET_PDEATHSIG
    sys.exit(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
if os.getppid() != parent:  # died before prctl: no signal will come
    os.kill(os.getpid(), sig)
    os._exit(1)  # sig is ignored here
os.execv(sys.argv[3], sys.argv[3:])
"""


def with_parent_death(command: list[str], sig: int, parent: int | None = None) -> list[str]:
    """`command` (argv, first item a path) run so that it gets `sig` when the thread that
    starts it dies, or at once if `parent` (default: this process) is gone already.

    Not a preexec_fn: that makes subprocess fork() (rather than vfork) and run the
    fork handlers of every library loaded here. grpc's restarts its EventEngine poller
    thread in the child; subprocess then closes every fd before exec, the epoll fd
    among them, and the child aborts ("epoll_wait error: Bad file descriptor") before
    it ever runs the command. A test process has grpc running after any gRPC test."""
    return [sys.executable, "-S", "-c", _PARENT_DEATH_LAUNCHER, str(int(sig)),
            str(os.getpid() if parent is None else parent), *command]


class ServerProcess:
    """`python -m shmserve.cli serve` in its own session.

    repo: the model repository; name: default unique_name(name_prefix); runtime_dir:
    default a private one of its own (removed by teardown); log_path: stdout and
    stderr of the server, appended; args: more `shmserve serve` arguments;
    parent_death_signal: what the server gets if the starting thread dies (None: nothing)."""

    def __init__(self, repo: Path, *, log_path: Path, name: str | None = None,
                 runtime_dir: Path | None = None, args=(), name_prefix: str = "shms",
                 parent_death_signal: int | None = signal.SIGTERM):
        self.repo = Path(repo).resolve()
        self.name = name or unique_name(name_prefix)
        self.owns_runtime_dir = runtime_dir is None
        self.runtime_dir = private_runtime_dir() if runtime_dir is None else Path(runtime_dir)
        self.log_path, self.args = Path(log_path), [str(a) for a in args]
        self.parent_death_signal = parent_death_signal
        self.proc: subprocess.Popen | None = None
        self.record: dict | None = None
        self.clients: list = []
        self.problems: list[str] = []  # of the last teardown
        self.leftover: list[str] = []  # /dev/shm segments of its own the last teardown found

    # -- where things are ----------------------------------------------------------
    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.sock"

    @property
    def record_path(self) -> Path:
        return self.runtime_dir / f"{self.name}.json"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def env(self) -> dict:
        """The environment in which `Client(name)` and the shmserve CLI find this server."""
        return {**os.environ, "SHMSERVE_RUNTIME_DIR": str(self.runtime_dir)}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "shmserve.cli", "serve", "--model-repository",
                str(self.repo), "--name", self.name, *self.args]

    # -- start ---------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> ServerProcess:
        """Starts the server and waits until its control socket accepts connections.
        RuntimeError (with the log's tail) if it exits or is not ready within timeout;
        the process is then left for teardown()."""
        command = self.command()
        if self.parent_death_signal is not None:
            command = with_parent_death(command, self.parent_death_signal)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env(),
                                         start_new_session=True)
        if not poll_until(lambda: self._connectable() or self.proc.poll() is not None, timeout):
            raise RuntimeError(f"server '{self.name}' not ready after {timeout} s:\n{self.log()}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"server '{self.name}' exited with code {self.proc.returncode} "
                               f"while starting:\n{self.log()}")
        self.record = json.loads(self.record_path.read_text())
        if self.record["pid"] != self.pid:
            raise RuntimeError(f"{self.record_path} names pid {self.record['pid']}, "
                               f"not the server started ({self.pid})")
        return self

    def _connectable(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket_path))
                return True
            except OSError:
                return False

    # -- use -----------------------------------------------------------------------
    def client(self, **kw) -> shmserve.Client:
        """A Client of this server, closed by teardown() at the latest."""
        c = shmserve.Client(self.name, socket_path_=str(self.socket_path), **kw)
        self.clients.append(c)
        return c

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def segments(self) -> list[str]:
        """The /dev/shm entries of the server's own (named with its prefix "shmserve-")
        that its processes hold or map: none, every segment is a memfd. (The regions
        users register through the fronts are named by them, never so.)"""
        return [n for n in shm_files(self.members()) if n.startswith(PREFIX + "-")]

    def arenas(self) -> list[str]:
        """The arenas (memfds) the coordinator holds open: one per live lease."""
        return open_memfds(self.pid, ARENA_LABEL)

    def members(self) -> list[int]:
        """Live processes of its process group: coordinator, batcher, workers."""
        return group_members(self.pid)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- stop ----------------------------------------------------------------------
    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Sends sig (SIGTERM: a clean shutdown) and waits; returns the exit code.
        subprocess.TimeoutExpired if it has not exited within timeout."""
        if self.running():
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL of the coordinator only (its children die by PDEATHSIG)."""
        os.kill(self.pid, signal.SIGKILL)

    def teardown(self, term_timeout: float = 15.0) -> list[str]:
        """Closes its clients, stops the server (SIGTERM; SIGKILL of the whole group
        if it or a child stays), then returns what it found wrong: processes left in
        its group, segments of its own in /dev/shm while it ran (there should be none,
        every segment is a memfd, so nothing of it can outlive its processes)."""
        problems = []
        for c in self.clients:
            try:
                c.close()
            except Exception as e:  # a close that raises is a finding of its own
                problems.append(f"Client.close() raised {type(e).__name__}: {e}")
        self.clients.clear()
        self.leftover = self.segments() if self.running() else []
        if self.leftover:
            problems.append(f"segments of its own in /dev/shm: {self.leftover}")
        if self.proc is not None:
            if self.running():
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(term_timeout)
                except subprocess.TimeoutExpired:
                    problems.append(f"server ignored SIGTERM for {term_timeout:g} s")
            if self.proc.poll() is None or self.members():
                if not poll_until(lambda: not self.members(), 5.0):
                    problems.append(f"processes left in the server's group: {self.members()}")
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc.wait(10)
        if self.owns_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.problems = problems
        return problems

    def __enter__(self) -> ServerProcess:
        try:
            return self.start()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, exc_type, *_) -> None:
        problems = self.teardown()
        if problems and exc_type is None:
            raise RuntimeError(f"server '{self.name}' left things behind:\n" + "\n".join(problems))
