"""What a benchmark sends requests to: a shmserve server (shm://NAME) or any
KServe v2 endpoint (grpc://, http://, grpc+shm://, http+shm://; see kserve.py).

A target is opened inside each client process. Its interface:

    meta = t.metadata()                     # {"inputs", "outputs", "max_batch_size"}
    t.prepare(data_sets, in_flight)         # once, before timing
    stamps = t.infer(i)                     # data set i, waits; 8 slot stamps or None
    t.submit(i, done)                       # returns at once; done(ok, error, stamps, end_ns)
    t.close()
"""
from __future__ import annotations

from .failures import error_text
from shmserve import protocol as P

NO_STAMPS = (0,) * 8


def parse_url(url: str) -> tuple[str, str]:
    """'shm://NAME' | 'NAME' -> ('shm', NAME); 'grpc://h:p' -> ('grpc', 'h:p'); ..."""
    if "://" not in url:
        return "shm", url or "default"
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in ("shm", "grpc", "http", "grpc+shm", "http+shm"):
        raise ValueError(f"unknown target '{url}': use shm://NAME, grpc://HOST:PORT, "
                         "http://HOST:PORT, grpc+shm://HOST:PORT or http+shm://HOST:PORT")
    return scheme, rest or ("default" if scheme == "shm" else rest)


def label(url: str) -> str:
    scheme, rest = parse_url(url)
    return f"shmserve ({rest})" if scheme == "shm" else f"{scheme}://{rest}"


def open_target(url: str, model: str, *, version=None, timeout_s: float = 30.0,
                options: dict | None = None):
    scheme, rest = parse_url(url)
    if scheme == "shm":
        return ShmTarget(rest, model, version, timeout_s, **(options or {}))
    from .kserve import KServeTarget
    return KServeTarget(scheme, rest, model, version, timeout_s)


class ShmTarget:
    """A shmserve server through shmserve.Client: outputs are views of shared
    memory released after each answer (copy=False), inputs copied in once."""

    def __init__(self, name: str, model: str, version=None, timeout_s: float = 30.0,
                 arena_bytes: int | None = None, spin_us: int | None = None,
                 socket_path: str | None = None):
        from shmserve.client import Client

        self.model, self.version, self.timeout = model, version, timeout_s
        self.client = Client(name, socket_path_=socket_path, arena_bytes=arena_bytes,
                             spin_us=spin_us)
        self.sets = []

    def metadata(self) -> dict:
        meta = self.client.model_metadata(self.model, self.version)
        return {"inputs": meta["inputs"], "outputs": meta["outputs"],
                "max_batch_size": meta.get("max_batch_size", 0)}

    def server_pid(self) -> int:
        return self.client.server_pid

    def prepare(self, data_sets: list[dict], in_flight: int) -> None:
        self.sets = data_sets

    def infer(self, i: int):
        res = self.client.infer(self.model, self.sets[i], version=self.version,
                                timeout=self.timeout)
        stamps = res.timestamps_ns
        res.release()
        return stamps

    def submit(self, i: int, done) -> None:
        fut = self.client.submit(self.model, self.sets[i], version=self.version)

        def finished(f):
            end = P.now_ns()
            e = f.exception()
            if e is not None:
                done(False, error_text(e), None, end)
                return
            res = f.result()
            stamps = res.timestamps_ns
            res.release()
            done(True, None, stamps, end)
        fut.add_done_callback(finished)

    def close(self) -> None:
        self.client.close()

