"""A buggy or hostile co-located caller writes whatever it likes into its own slots,
its arena and the shared ring. The server must refuse malformed requests with an
error for that caller only, and never crash or stop serving the others."""
from __future__ import annotations

import contextlib
import multiprocessing
import struct
import threading
import time

import helpers
import numpy as np
import pytest
from helpers import SLEEPER_CODE, RawLease, assert_serving, python_config, write_model

from shmserve import errors
from shmserve import protocol as P
from shmserve.protocol import LAYOUT as L
from shmserve.protocol import Status

pytestmark = pytest.mark.timeout(60)

FP32, BYTES = 11, 13
BAD = {Status.BAD_DESCRIPTOR, Status.INVALID_ARG}


@pytest.fixture(scope="module")
def raw(main_server):
    lease = RawLease(main_server.socket_path, arena_bytes=1 << 20)
    children = main_server.members()
    yield lease
    lease.close()
    # Nobody crashed or was restarted because of what this module sent.
    assert main_server.members() == children


def cases(raw: RawLease):
    """name -> (model, n_inputs, n_outputs, inputs, outputs, expected statuses, message)."""
    d, end = raw.data_offset, raw.arena_bytes
    slots = raw.hello["slots_offset"]
    good_in = (0, FP32, 2, d, 16, (1, 4))
    good_out = (0, 0, 0, d + 4096, 4096, ())
    huge = 2**64 - 64
    return {
        "input offset past the arena": ("identity", 1, 1, [(0, FP32, 2, end + 64, 16, (1, 4))],
                                        [good_out], {Status.BAD_DESCRIPTOR}, "outside"),
        "input in the slot table": ("identity", 1, 1, [(0, FP32, 2, slots, 16, (1, 4))],
                                    [good_out], {Status.BAD_DESCRIPTOR}, "outside"),
        "input in the arena header": ("identity", 1, 1, [(0, FP32, 2, 0, 16, (1, 4))],
                                      [good_out], {Status.BAD_DESCRIPTOR}, "outside"),
        "input offset unaligned": ("identity", 1, 1, [(0, FP32, 2, d + 8, 16, (1, 4))],
                                   [good_out], {Status.BAD_DESCRIPTOR},
                                   f"input 'INPUT0' data offset {d + 8} is not a multiple of 64"),
        "input offset unaligned and past the arena": (
            "identity", 1, 1, [(0, FP32, 2, end + 8, 16, (1, 4))], [good_out],
            {Status.BAD_DESCRIPTOR}, "is not a multiple of 64"),
        "output offset unaligned": ("identity", 1, 1, [good_in], [(0, 0, 0, d + 4100, 64, ())],
                                    {Status.BAD_DESCRIPTOR},
                                    f"output 'OUTPUT0' buffer offset {d + 4100} is not a multiple "
                                    "of 64"),
        "input nbytes 2^63": ("identity", 1, 1, [(0, FP32, 2, d, 2**63, (1, 4))], [good_out],
                              {Status.BAD_DESCRIPTOR}, "outside"),
        "input offset wraps around": ("identity", 1, 1, [(0, FP32, 2, huge, 128, (1, 32))],
                                      [good_out], {Status.BAD_DESCRIPTOR}, "outside"),
        "1000 inputs": ("identity", 1000, 1, [good_in], [good_out], {Status.BAD_DESCRIPTOR},
                        "1000 inputs"),
        "1000 outputs": ("identity", 1, 1000, [good_in], [good_out], {Status.BAD_DESCRIPTOR},
                         "1000 outputs"),
        "ndim 99": ("identity", 1, 1, [(0, FP32, 99, d, 16, (1, 4))], [good_out], BAD, "99"),
        "negative dimension": ("identity", 1, 1, [(0, FP32, 2, d, 16, (1, -4))], [good_out], BAD,
                               "negative"),
        "negative batch": ("identity", 1, 1, [(0, FP32, 2, d, 16, (-1, -4))], [good_out], BAD,
                           "INPUT0"),
        "shape overflows": ("identity", 1, 1, [(0, FP32, 2, d, 16, (1, 2**62))], [good_out], BAD,
                            "INPUT0"),
        "nbytes not the shape's": ("identity", 1, 1, [(0, FP32, 2, d, 20, (1, 4))], [good_out],
                                   BAD, "20"),
        "unknown model id": (10**6, 1, 1, [good_in], [good_out], {Status.NOT_FOUND}, "model"),
        "input index out of range": ("identity", 1, 1, [(15, FP32, 2, d, 16, (1, 4))],
                                     [good_out], BAD, "15"),
        "dtype 200": ("identity", 1, 1, [(0, 200, 2, d, 16, (1, 4))], [good_out], BAD,
                      "data type"),
        "input given twice": ("simple", 2, 2, [(0, 8, 2, d, 64, (1, 16))] * 2,
                              [good_out, (1, 0, 0, d + 8192, 4096, ())], BAD, "twice"),
        "no output": ("identity", 1, 0, [good_in], [], BAD, "no output"),
        "output index out of range": ("identity", 1, 1, [good_in], [(3, 0, 0, d + 4096, 64, ())],
                                      BAD, "output index 3"),
        "output twice": ("identity", 1, 2, [good_in], [good_out, good_out], BAD, "twice"),
        "input in device memory": ("identity", 1, 1, [(0, FP32, 2, d, 16, (1, 4), 1, 0)],
                                   [good_out], BAD, "memory kind 1"),
        "output on GPU 2": ("identity", 1, 1, [good_in], [(0, 0, 0, d + 4096, 64, (), 0, 2)], BAD,
                            "device 2"),
        "output past the arena": ("identity", 1, 1, [good_in], [(0, 0, 0, end - 64, 4096, ())],
                                  {Status.BAD_DESCRIPTOR}, "outside"),
        "output into the slot table": ("identity", 1, 1, [good_in], [(0, 0, 0, slots, 4096, ())],
                                       {Status.BAD_DESCRIPTOR}, "outside"),
        "output into the arena header": ("identity", 1, 1, [good_in], [(0, 0, 0, 0, 64, ())],
                                         {Status.BAD_DESCRIPTOR}, "outside"),
        "BYTES length past its buffer": ("id_BYTES", 1, 1, [(0, BYTES, 2, d + 8192, 8, (1, 1))],
                                         [good_out], BAD, "claims"),
        "BYTES fewer elements than shape": ("id_BYTES", 1, 1,
                                            [(0, BYTES, 2, d + 8192, 8, (1, 1000))], [good_out],
                                            BAD, "INPUT0"),
    }


def _case_names():
    class Shape:  # only the names are needed at collection time
        data_offset, arena_bytes, hello = 4096, 1 << 20, {"slots_offset": 128}
    return list(cases(Shape()))


@pytest.mark.parametrize("case", _case_names())
def test_malformed_descriptor_is_refused(raw, client, case):
    model, n_in, n_out, inputs, outputs, expected, text = cases(raw)[case]
    model_id = raw.model_ids[model] if isinstance(model, str) else model
    d = raw.data_offset
    raw.buf[d:d + 16] = np.arange(4, dtype=np.float32).tobytes()
    struct.pack_into("<II", raw.buf, d + 8192, 0xFFFFFFF0, 0)  # a BYTES length of ~4 GiB
    gen = raw.write_raw_request(0, model_id, n_in, n_out, inputs, outputs)
    assert raw.push(0, gen) == 0
    answer = raw.wait_done(0, timeout=20)
    assert answer is not None, "the server never answered a malformed request"
    status, message = answer
    assert status in expected, (Status(status).name, message)
    assert text in message, message
    if isinstance(model, str):
        assert f"'{model}'" in message, message
    assert_serving(client)


def test_well_formed_raw_request_works(raw):
    """The raw writer itself is right: the same path with a valid descriptor."""
    d = raw.data_offset
    x = np.array([[1.5, -2, 3, 4]], np.float32)
    raw.buf[d:d + 16] = x.tobytes()
    gen = raw.write_raw_request(0, raw.model_ids["identity"], 1, 1, [(0, FP32, 2, d, 16, (1, 4))],
                                [(0, 0, 0, d + 4096, 4096, ())])
    raw.push(0, gen)
    status, message = raw.wait_done(0)
    assert (status, message) == (Status.OK, "")
    assert bytes(raw.buf[d + 4096:d + 4112]) == x.tobytes()


def test_bogus_ring_entries_are_ignored(raw, client, main_server):
    d = raw.data_offset
    raw.buf[d:d + 16] = bytes(16)
    gen = raw.write_raw_request(1, raw.model_ids["identity"], 1, 1, [(0, FP32, 2, d, 16, (1, 4))],
                                [(0, 0, 0, d + 4096, 4096, ())])
    raw.push(1, gen + 5)          # wrong generation
    raw.push(10**6, gen)          # no such slot
    raw.push(1, gen, client_id=63)                         # a client id with no lease
    raw.push(1, gen, client_id=2**31 - 1)                  # no such client at all
    raw.push(1, gen, client_id=client.client_id)           # someone else's (idle) slot
    assert_serving(client)  # its ring entry comes after the bogus ones: they were seen first
    # None of those entries was its own, yet the request is answered once, correctly:
    # the batcher's sweep of slot states finds SUBMITTED requests the ring lacks.
    assert raw.wait_done(1, timeout=10) == (Status.OK, "")
    assert bytes(raw.buf[d + 4096:d + 4112]) == bytes(16)


def test_garbage_bytes_request_fails_alone(raw, main_server, make_client):
    """A malformed BYTES request batched with a good one fails only itself."""
    c = make_client(arena_bytes=1 << 20)
    good = np.array([[b"fine", b""]], dtype=object)
    d = raw.data_offset
    struct.pack_into("<I", raw.buf, d + 8192, 0xFFFFFFF0)
    for _ in range(10):
        gen = raw.write_raw_request(0, raw.model_ids["id_BYTES"], 1, 1,
                                    [(0, BYTES, 2, d + 8192, 8, (1, 1))],
                                    [(0, 0, 0, d + 4096, 4096, ())])
        raw.push(0, gen)
        out = c.submit("id_BYTES", [good])
        assert out.result(timeout=20)["OUTPUT0"].tolist() == good.tolist()
        assert raw.wait_done(0)[0] in BAD


# ---------------------------------------------------------------- attacks that need a server of their own

def with_sleeper(repo):
    write_model(repo, "sleeper", python_config("sleeper", "FP32", (-1,), dynamic_batching=None),
                SLEEPER_CODE)


def _survived_the_hostile_request(server, victim, before: list[int]) -> None:
    """Once the sleeper has run the hostile caller's request to its end (and written its
    output into that caller's arena), it serves the victim and no server process died."""
    helpers.wait_until(lambda: victim.statistics("sleeper")[0]["execution_count"] >= 1, 10,
                       "the sleeper to finish the hostile request")
    x = np.array([[0.0, 1.0]], np.float32)
    np.testing.assert_array_equal(victim.infer("sleeper", [x], timeout=3)["OUTPUT0"], x)
    assert server.members() == before, "a server process died:\n" + server.log(1500)


def test_arena_header_overwritten_while_running(server_factory):
    server = server_factory(setup=with_sleeper)
    victim = server.client(arena_bytes=1 << 20)
    raw = RawLease(server.socket_path)
    try:
        before = server.members()
        helpers.start_sleeper_request(raw, 0.5)
        raw.buf[0:8] = bytes(8)  # the magic
        _survived_the_hostile_request(server, victim, before)
    finally:
        raw.close()


def test_arena_truncated_by_its_client(server_factory):
    """Arenas are memfds sealed against shrinking: ftruncate fails (EPERM), so no
    caller can make the server's mapping of its arena SIGBUS."""
    server = server_factory(setup=with_sleeper)
    victim = server.client(arena_bytes=1 << 20)
    before = server.members()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=helpers.truncating_client, args=(str(server.socket_path), ready))
    proc.start()
    try:
        assert ready.wait(30)
        proc.join(10)  # it returns at once if the truncation was refused
        assert proc.exitcode == 0, "a caller could shrink its own arena (ftruncate succeeded)"
        _survived_the_hostile_request(server, victim, before)
    finally:
        proc.kill()
        proc.join()


def _claim_head_forever(raw: RawLease, victim):
    pos = raw.ctl.load64(L["control.enqueue_pos"])
    cap = raw.ctl.load32(L["control.ring_capacity"])
    cell = L["control.size"] + (pos % cap) * L["ring_cell.size"]
    word = (1 << 63) | (raw.client_id << 32) | (pos & 0xFFFFFFFF)
    raw.ctl.store64(cell, word)  # claimed by a live client that never publishes
    raw.ctl.store64(L["control.enqueue_pos"], pos + 1)


def _stop_flag(raw: RawLease, victim):
    raw.ctl.store32(L["control.server_state"], 2)  # STOPPED


def _jump_enqueue(raw: RawLease, victim):
    raw.ctl.store64(L["control.enqueue_pos"], raw.ctl.load64(L["control.enqueue_pos"]) + 10**9)


def _rewrite_ring_header(raw: RawLease, victim):
    raw.ctl.store32(L["control.ring_capacity"], 1 << 30)
    raw.ctl.store32(L["control.ring_offset"], 8)
    raw.ctl.store64(L["control.dequeue_pos"], 777)


def _garbage_in_every_cell(raw: RawLease, victim):
    cap = raw.ring.capacity
    rng = np.random.default_rng(5)
    for i in range(cap):
        raw.ctl.store64(L["control.size"] + i * L["ring_cell.size"], int(rng.integers(0, 2**63)))


def _batcher_never_woken(raw: RawLease, victim):
    raw.ctl.store32(L["control.batcher_sleeping"], 0)


CONTROL_ATTACKS = {
    "claim-never-published": _claim_head_forever, "server-state-stopped": _stop_flag,
    "enqueue-jump": _jump_enqueue, "ring-header-rewritten": _rewrite_ring_header,
    "garbage-cells": _garbage_in_every_cell,
    "batcher-sleeping-zeroed": _batcher_never_woken,
}


@pytest.mark.parametrize("attack", CONTROL_ATTACKS.values(), ids=CONTROL_ATTACKS.keys())
def test_control_block_vandalism_affects_only_the_vandal(server_factory, attack):
    server = server_factory()
    victim = server.client(arena_bytes=1 << 20)
    assert_serving(victim)
    raw = RawLease(server.socket_path)
    try:
        before = server.members()
        attack(raw, victim)
        x = np.ones((1, 4), np.float32)
        try:
            for _ in range(5):
                np.testing.assert_array_equal(victim.infer("identity", [x], timeout=3)["OUTPUT0"], x)
        except errors.ShmServeError as e:
            pytest.fail(f"one caller's writes broke the service for another: {e!r}")
        assert server.members() == before, "a server process died:\n" + server.log(1500)
    finally:
        raw.close()


def test_zeroed_sleeping_flag_heals_after_one_sleep(server_factory):
    """batcher_sleeping is the batcher's alone to count: zeroed once by a vandal, it is
    set again on the batcher's next sleep, so pushes ring it again (a count would stay
    one off for good and every request would wait for the batcher's idle tick)."""
    server = server_factory()
    victim = server.client(arena_bytes=1 << 20)
    assert_serving(victim)
    raw = RawLease(server.socket_path)
    try:
        sleeping = L["control.batcher_sleeping"]
        helpers.wait_until(lambda: raw.ctl.load32(sleeping) != 0, 10,
                           "the batcher never went to sleep")
        raw.ctl.store32(sleeping, 0)
        assert_serving(victim)  # wakes the batcher by its tick at worst; it sleeps again
        helpers.wait_until(lambda: raw.ctl.load32(sleeping) != 0, 10,
                           "one zeroing of batcher_sleeping outlasted the batcher's next sleep")
    finally:
        raw.close()


@contextlib.contextmanager
def vandal_loop(raw: RawLease, act):
    """Runs act(raw) in a loop on a thread for the with-block (a hostile client)."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            act(raw)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_flag_zeroed_again_and_again_makes_the_batcher_poll(server_factory):
    """A vandal zeroing batcher_sleeping in a loop keeps every push from ringing the
    batcher; once a sleep ran its whole course though the doorbell moved, the batcher
    says so and polls (batcher.py, WATCHFUL_NS) instead of waiting for its idle check."""
    server = server_factory(args=["--idle-check-ms", "300"])
    victim = server.client(arena_bytes=1 << 20)
    assert_serving(victim)
    raw = RawLease(server.socket_path)

    def zero_the_flag(raw):
        raw.ctl.store32(L["control.batcher_sleeping"], 0)
        time.sleep(0.0001)

    try:
        with vandal_loop(raw, zero_the_flag):
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            for _ in range(20):
                np.testing.assert_array_equal(victim.infer("identity", [x], timeout=10)["OUTPUT0"], x)
            helpers.wait_until(lambda: "a push did not wake the batcher" in server.log(20000), 10,
                               "the batcher did not notice the pushes that did not wake it")
    finally:
        raw.close()


def test_a_doorbell_rung_in_a_loop_is_tuned_out(server_factory):
    """Rings for nothing (far more than requests and batches) make the batcher stop
    listening to the doorbell for a while and look on its own clock (batcher.py,
    NOISE_RINGS); honest traffic, however heavy, never does."""
    server = server_factory()
    victim = server.client(arena_bytes=1 << 20)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    for _ in range(20):  # heavy, honest: 100 requests in flight at a time
        futures = [victim.submit("identity", [x]) for _ in range(100)]
        for f in futures:
            r = f.result(timeout=30)
            np.testing.assert_array_equal(r["OUTPUT0"], x)
            r.release()
    assert "a client rings it in a loop" not in server.log(20000), server.log(20000)
    raw = RawLease(server.socket_path)

    def ring(raw):
        raw.ctl.store32(L["control.batcher_sleeping"], 1)
        raw.ctl.doorbell_ring(L["control.doorbell"], L["control.batcher_sleeping"])

    try:
        with vandal_loop(raw, ring):
            helpers.wait_until(lambda: "a client rings it in a loop" in server.log(20000), 20,
                               "the batcher kept listening to a doorbell rung for nothing")
            for _ in range(20):
                np.testing.assert_array_equal(victim.infer("identity", [x], timeout=10)["OUTPUT0"], x)
    finally:
        raw.close()


def test_control_segment_and_arena_cannot_be_resized_by_a_client(main_server):
    """Both descriptors of the hello reply are memfds sealed against resizing: a
    shrunk control segment would SIGBUS the coordinator, the batcher and every client."""
    import os
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(main_server.socket_path))
    try:
        sock.sendall(P.pack_frame({"op": P.OP_HELLO, "version": P.PROTOCOL_VERSION,
                                   "arena_bytes": 1 << 16}))
        reply, fds = P.recv_frame_fds(sock, 2)
        assert reply["ok"] and len(fds) == 2, (reply, fds)
        try:
            for fd, what in zip(fds, ("arena", "control")):
                for size in (0, os.fstat(fd).st_size + 4096):
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, size)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        sock.close()


def test_request_whose_ring_entry_was_lost_is_answered(main_server):
    """A SUBMITTED request with no ring entry (another client overwrote the cell) is
    found by the batcher's periodic sweep of slot states and answered."""
    raw = RawLease(main_server.socket_path)
    try:
        d = raw.data_offset
        raw.buf[d:d + 16] = np.arange(4, dtype=np.float32).tobytes()
        raw.write_raw_request(0, raw.model_ids["identity"], 1, 1, [(0, FP32, 2, d, 16, (1, 4))],
                              [(0, 0, 0, d + 4096, 4096, ())])  # SUBMITTED, never pushed
        assert raw.wait_done(0, timeout=10) == (0, "")
        assert bytes(raw.buf[d + 4096:d + 4096 + 16]) == np.arange(4, dtype=np.float32).tobytes()
    finally:
        raw.close()


# ---------------------------------------------------------------- the control socket

def _exchange(sock, body: bytes) -> dict:
    from shmserve import protocol as P

    sock.sendall(P.FRAME_HEADER.pack(len(body)) + body)
    return P.recv_frame(sock)


_pack = __import__("msgpack").packb
# name: (body, what the error reply says); every one is code 1 (malformed / invalid).
MALFORMED_CONTROL = {
    "not msgpack": (b"hello", "malformed control message"),
    "not a map": (_pack([1, 2]), "control frame is not a map"),
    "unknown op": (_pack({"op": "format_disk"}), "unknown control operation 'format_disk'"),
    "op as bin": (_pack({"op": b"models"}, use_bin_type=True),
                  "malformed control message: ValueError: field 'op' must be str, got bytes"),
    "arena size not a number": (
        _pack({"op": "hello", "version": P.PROTOCOL_VERSION, "arena_bytes": "lots"}),
        "field 'arena_bytes' must be int, got str"),
    "wrong protocol version": (_pack({"op": "hello", "version": 99, "arena_bytes": 4096}),
                               "protocol version 99 not supported"),
    "protocol version an empty string": (_pack({"op": "hello", "version": ""}),
                                         "field 'version' must be int or nil, got str"),
    "version not a number": (_pack({"op": "metadata", "model": "identity", "version": "abc"}),
                             "field 'version' must be int or nil, got str"),
    "model name a number": (_pack({"op": "metadata", "model": 5}),
                            "GetMetadata: field 'model' must be str, got int"),
    "model name not a string": (_pack({"op": "metadata", "model": [1]}),
                                "field 'model' must be str, got list"),
}


def test_malformed_control_messages_get_error_replies(main_server, client):
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(main_server.socket_path))
    sock.settimeout(10)
    try:
        for name, (body, says) in MALFORMED_CONTROL.items():
            reply = _exchange(sock, body)  # same connection: it stays usable
            assert reply["ok"] is False and reply["code"] == 1, (name, reply)
            assert says in reply["error"], (name, reply)
        # an oversized frame ends that connection, and only that one
        from shmserve import protocol as P
        sock.sendall(P.FRAME_HEADER.pack(P.MAX_FRAME_BYTES + 1))
        assert sock.recv(1) == b""
    finally:
        sock.close()
    assert_serving(client)


def test_infinite_arena_request_gets_an_error_reply(main_server):
    import socket

    import msgpack

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(main_server.socket_path))
    sock.settimeout(10)
    try:
        reply = _exchange(sock, msgpack.packb({"op": "hello", "version": P.PROTOCOL_VERSION,
                                               "arena_bytes": float("inf")}))
        assert reply["ok"] is False and "arena" in reply["error"]
    finally:
        sock.close()
