"""Which HTTP stack the front uses, by measurement: a trivial KServe-like POST (4 KiB body
in, small JSON out) answered by uvicorn+httptools, aiohttp and granian (each on uvloop,
one process), timed from one keep-alive connection with http.client. Prints medians.

    PYTHONPATH=. python bench/http_stacks.py [--requests 3000]
"""
from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

BODY = b"x" * 4096
REPLY = b'{"model_name":"identity","outputs":[]}'

APPS = {
    "uvicorn+httptools": textwrap.dedent(f"""
        import uvicorn
        REPLY = {REPLY!r}
        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            more = True
            while more:
                msg = await receive(); more = msg.get("more_body", False)
            await send({{"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]}})
            await send({{"type": "http.response.body", "body": REPLY}})
        uvicorn.run(app, host="127.0.0.1", port=PORT, http="httptools", loop="uvloop",
                    log_level="warning", access_log=False)
    """),
    "aiohttp": textwrap.dedent(f"""
        import uvloop
        from aiohttp import web
        REPLY = {REPLY!r}
        async def infer(request):
            await request.read()
            return web.Response(body=REPLY, content_type="application/json")
        app = web.Application(); app.router.add_post("/v2/models/identity/infer", infer)
        uvloop.install()
        web.run_app(app, host="127.0.0.1", port=PORT, print=None, access_log=None)
    """),
    "granian (asgi)": textwrap.dedent("""
        from granian import Granian
        from granian.constants import Interfaces, Loops
        Granian("app_mod:app", address="127.0.0.1", port=PORT, interface=Interfaces.ASGI,
                loop=Loops.uvloop, workers=1, log_enabled=False).serve()
    """),
}
GRANIAN_APP = APPS["uvicorn+httptools"].split("uvicorn.run")[0].replace("import uvicorn", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def measure(port: int, n: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    times = []
    for i in range(n + 200):
        t = time.perf_counter()
        conn.request("POST", "/v2/models/identity/infer", BODY,
                     {"Content-Type": "application/octet-stream"})
        conn.getresponse().read()
        if i >= 200:  # warm-up left out
            times.append(time.perf_counter() - t)
    conn.close()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="http-stacks-")  # granian imports its app by module name
    for name, code in APPS.items():
        port = free_port()
        env = dict(os.environ)
        if name.startswith("granian"):
            path = os.path.join(workdir, "app_mod.py")
            with open(path, "w") as f:
                f.write(GRANIAN_APP)
            env["PYTHONPATH"] = workdir + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen([sys.executable, "-c", code.replace("PORT", str(port))], env=env)
        try:
            wait_port(port)
            print(f"{name:20s} median {measure(port, args.requests):7.1f} us per request")
        finally:
            proc.terminate()
            proc.wait(10)
            if name.startswith("granian"):
                os.unlink(os.path.join(workdir, "app_mod.py"))
    os.rmdir(workdir)


if __name__ == "__main__":
    main()
