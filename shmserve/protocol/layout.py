"""The shared-memory layout as Python sees it: every size, offset, constant and enum
comes from the compiled C core (csrc/shmserve.h), never written here by hand."""
from __future__ import annotations

import enum

from .. import _core

LAYOUT: dict[str, int] = _core.layout()
now_ns = _core.now_ns  # CLOCK_MONOTONIC, the clock of every timestamp in a slot
PROTOCOL_VERSION = LAYOUT["PROTOCOL_VERSION"]
MAX_TENSORS = LAYOUT["MAX_TENSORS"]
MAX_DIMS = LAYOUT["MAX_DIMS"]
NAME_BYTES = LAYOUT["NAME_BYTES"]
DATA_ALIGN = LAYOUT["DATA_ALIGN"]
MAX_BATCH_REQUESTS = LAYOUT["MAX_BATCH_REQUESTS"]
SLOT_BYTES = LAYOUT["slot.size"]


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARG = 1
    NOT_FOUND = 2
    UNAVAILABLE = 3
    OUTPUT_TOO_SMALL = 4
    INTERNAL = 5
    BUSY = 6
    BAD_DESCRIPTOR = 7


class SlotState(enum.IntEnum):
    FREE = 0
    SUBMITTED = 1
    QUEUED = 2
    RUNNING = 3
    DONE = 4


class ServerState(enum.IntEnum):
    STARTING = 0
    READY = 1
    STOPPED = 2


class ClientState(enum.IntEnum):
    FREE = 0
    ALIVE = 1
    DEAD = 2


class Timestamp(enum.IntEnum):
    CLIENT_WRITE = 0
    ENQUEUE = 1
    DEQUEUE = 2
    BATCHED = 3
    COMPUTE_START = 4
    COMPUTE_END = 5
    COMPLETE = 6
    CLIENT_WAKE = 7
