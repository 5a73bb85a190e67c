"""KServe v2 endpoints through tritonclient, for `--compare` (and `-u`): gRPC,
HTTP, and either with system shared memory (`grpc+shm://`, `http+shm://`: inputs
copied into a POSIX region inside the timed call, outputs read from one).

tritonclient is imported here only, lazily. tritonclient[grpc] is a dependency of
shmserve; HTTP needs `pip install 'tritonclient[http]'`.
"""
from __future__ import annotations

import threading
import uuid

import numpy as np

from shmserve import protocol as P
from .failures import error_text


def _module(proto: str):
    try:
        if proto == "grpc":
            import tritonclient.grpc as m
        else:
            import tritonclient.http as m
    except (ImportError, RuntimeError) as e:  # tritonclient raises RuntimeError for a missing extra
        extra = "grpc" if proto == "grpc" else "http"
        raise RuntimeError(f"{proto}:// targets need tritonclient[{extra}] "
                           f"(pip install 'tritonclient[{extra}]'): {e}") from None
    return m


class KServeTarget:
    def __init__(self, scheme: str, url: str, model: str, version=None, timeout_s: float = 30.0):
        self.proto, _, shm = scheme.partition("+")
        self.use_shm = shm == "shm"
        self.url, self.model = url, model
        self.version = "" if version in (None, 0, -1) else str(version)
        self.timeout = timeout_s
        self.m = _module(self.proto)
        self._local = threading.local()
        self.client = self._new_client()
        self.regions = []
        self._free = []
        self._lock = threading.Lock()
        self._pool = None

    def _new_client(self):
        if self.proto == "grpc":
            return self.m.InferenceServerClient(self.url)
        # Accept-Encoding identity: a compressed answer is not what we measure
        return self.m.InferenceServerClient(self.url, connection_timeout=self.timeout,
                                            network_timeout=self.timeout)

    def _client(self):
        if self.proto == "grpc":
            return self.client  # thread-safe
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._new_client()
        return c

    def metadata(self) -> dict:
        if self.proto == "grpc":
            meta = self.client.get_model_metadata(self.model, self.version, as_json=True)
            cfg = self.client.get_model_config(self.model, self.version, as_json=True)["config"]
        else:
            meta = self.client.get_model_metadata(self.model, self.version)
            cfg = self.client.get_model_config(self.model, self.version)
        norm = lambda ts: [{"name": t["name"], "datatype": t["datatype"],
                            "shape": [int(d) for d in t["shape"]]} for t in ts]
        return {"inputs": norm(meta["inputs"]), "outputs": norm(meta["outputs"]),
                "max_batch_size": int(cfg.get("max_batch_size", 0))}

    def server_pid(self):
        return None

    # -------------------------------------------------------------- requests
    def prepare(self, data_sets: list[dict], in_flight: int) -> None:
        meta = self.metadata()
        self.sets = data_sets
        self.out_names = [t["name"] for t in meta["outputs"]]
        if not self.use_shm:
            self.requests = []
            for s in data_sets:
                ins = []
                for name, arr in s.items():
                    inp = self.m.InferInput(name, list(arr.shape), P.DTYPE_NAMES[P.dtype_code(arr.dtype)])
                    if self.proto == "grpc":
                        inp.set_data_from_numpy(arr)
                    else:
                        inp.set_data_from_numpy(arr, binary_data=True)
                    ins.append(inp)
                outs = [self.m.InferRequestedOutput(n) if self.proto == "grpc"
                        else self.m.InferRequestedOutput(n, binary_data=True) for n in self.out_names]
                self.requests.append((ins, outs))
            return
        import tritonclient.utils.shared_memory as shm

        self.shm = shm
        in_bytes = max(sum(a.nbytes for a in s.values()) for s in data_sets)
        # outputs: exact when the config fixes the shape, else as large as the inputs
        rows = next(iter(data_sets[0].values())).shape[0] if meta["max_batch_size"] > 0 else 1
        self.out_sizes = []
        for t in meta["outputs"]:
            dims = t["shape"][1:] if meta["max_batch_size"] > 0 else t["shape"]
            item = P.numpy_dtype(P.DTYPE_CODES[t["datatype"]]).itemsize
            self.out_sizes.append(rows * int(np.prod(dims)) * item if all(d >= 0 for d in dims)
                                  else in_bytes)
        tag = uuid.uuid4().hex[:8]
        for k in range(max(1, in_flight)):
            name = f"bench{tag}_{k}"
            hin = shm.create_shared_memory_region(name + "_in", f"/{name}_in", in_bytes)
            self.client.register_system_shared_memory(name + "_in", f"/{name}_in", in_bytes)
            outs = []
            for j, size in enumerate(self.out_sizes):
                h = shm.create_shared_memory_region(f"{name}_out{j}", f"/{name}_out{j}", size)
                self.client.register_system_shared_memory(f"{name}_out{j}", f"/{name}_out{j}", size)
                outs.append((f"{name}_out{j}", h, size))
            self.regions.append((name + "_in", hin, outs))
        self._free = list(range(len(self.regions)))

    def _shm_request(self, i: int, r: int):
        name, hin, outs = self.regions[r]
        arrays = list(self.sets[i].items())
        self.shm.set_shared_memory_region(hin, [a for _, a in arrays])  # the copy in, timed
        ins, offset = [], 0
        for n, a in arrays:
            inp = self.m.InferInput(n, list(a.shape), P.DTYPE_NAMES[P.dtype_code(a.dtype)])
            inp.set_shared_memory(name, a.nbytes, offset)
            offset += a.nbytes
            ins.append(inp)
        req_outs = []
        for n, (oname, _, size) in zip(self.out_names, outs):
            o = self.m.InferRequestedOutput(n) if self.proto == "grpc" else \
                self.m.InferRequestedOutput(n, binary_data=True)
            o.set_shared_memory(oname, size)
            req_outs.append(o)
        return ins, req_outs

    def _read_shm_outputs(self, result, r: int) -> None:
        _, _, outs = self.regions[r]
        for n, (_, h, _) in zip(self.out_names, outs):
            o = result.get_output(n)
            if o is None:
                continue
            if self.proto == "grpc":
                shape, dt = list(o.shape), o.datatype
            else:
                shape, dt = o["shape"], o["datatype"]
            np.array(self.shm.get_contents_as_numpy(h, P.numpy_dtype(P.DTYPE_CODES[dt]), shape))

    def _infer_once(self, i: int, r: int | None):
        if self.use_shm:
            ins, outs = self._shm_request(i, r)
        else:
            ins, outs = self.requests[i]
        kw = {"client_timeout": self.timeout} if self.proto == "grpc" else \
            {"headers": {"Accept-Encoding": "identity"}}
        result = self._client().infer(self.model, ins, model_version=self.version, outputs=outs, **kw)
        if self.use_shm:
            self._read_shm_outputs(result, r)
        else:
            for n in self.out_names:
                result.as_numpy(n)
        return None

    def infer(self, i: int):
        if not self.use_shm:
            return self._infer_once(i, None)
        r = self._take()
        try:
            return self._infer_once(i, r)
        finally:
            self._give(r)

    def _take(self) -> int:
        with self._lock:
            return self._free.pop()

    def _give(self, r: int) -> None:
        with self._lock:
            self._free.append(r)

    def submit(self, i: int, done) -> None:
        if self.proto == "grpc" and not self.use_shm:
            ins, outs = self.requests[i]

            def cb(result, error):
                end = P.now_ns()
                if error is not None:
                    done(False, error_text(error), None, end)
                else:
                    for n in self.out_names:
                        result.as_numpy(n)
                    done(True, None, None, end)
            self.client.async_infer(self.model, ins, cb, model_version=self.version, outputs=outs,
                                    client_timeout=self.timeout)
            return
        # HTTP and system shared memory: blocking calls on a pool of threads
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max(1, len(self.regions) or 32))

        def run():
            try:
                self.infer(i)
                done(True, None, None, P.now_ns())
            except Exception as e:  # noqa: BLE001 - counted as an error of the run
                done(False, error_text(e), None, P.now_ns())
        self._pool.submit(run)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for name, hin, outs in self.regions:
            for n, h in [(name, hin)] + [(o[0], o[1]) for o in outs]:
                try:
                    self.client.unregister_system_shared_memory(n)
                except Exception:  # noqa: BLE001 - the server may be gone
                    pass
                self.shm.destroy_shared_memory_region(h)
        self.regions = []
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass
