"""The control socket: frames (a 4-byte big-endian length, then one msgpack map) and
the operations a client may ask for."""
from __future__ import annotations

import os
import socket
import struct

import msgpack
# A frame is a 4-byte big-endian length followed by one msgpack map. Requests carry
# "op"; replies carry "ok" and either the answer or "code" and "error".
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 << 20

OP_HELLO = "hello"        # {version, pid, arena_bytes} -> lease, control name; arena memfd attached
OP_MODELS = "models"      # {} -> {models: [metadata...]}
OP_METADATA = "metadata"  # {model, version?} -> metadata
OP_CONFIG = "config"      # {model, version?} -> {config: text}
OP_STATS = "stats"        # {model?} -> {models: [{name, version, ...counters}]}


def pack_frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME_HEADER.pack(len(body)) + body


def unpack_body(body: bytes) -> dict:
    message = msgpack.unpackb(body, raw=False)
    if not isinstance(message, dict):
        raise ValueError("control frame is not a map")
    return message


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Reads exactly n bytes from a stream socket (a short read is not a frame)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("control socket closed by the peer")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    return recv_frame_fds(sock, 0)[0]


def recv_frame_fds(sock: socket.socket, max_fds: int = 1) -> tuple[dict, list[int]]:
    """A frame and the descriptors sent with it (SCM_RIGHTS on its first bytes: the
    hello reply carries the arena's and the control segment's memfds). The caller owns
    the descriptors."""
    header, fds = b"", []
    while len(header) < FRAME_HEADER.size:
        if max_fds:
            data, got, _, _ = socket.recv_fds(sock, FRAME_HEADER.size - len(header), max_fds,
                                              socket.MSG_CMSG_CLOEXEC)
            fds += got
        else:
            data = sock.recv(FRAME_HEADER.size - len(header))
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("control socket closed by the peer")
        header += data
    (length,) = FRAME_HEADER.unpack(header)
    try:
        if length > MAX_FRAME_BYTES:
            raise ValueError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        return unpack_body(recv_exact(sock, length)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
