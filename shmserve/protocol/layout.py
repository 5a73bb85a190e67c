"""The shared-memory layout as Python sees it: every size, offset, constant and enum
comes from the compiled C core (csrc/shms_layout.h's tables), never typed here.

LAYOUT["slot.state"] is a field's offset, LAYOUT["slot.state.bytes"] its size,
LAYOUT["slot.size"] a struct's size, LAYOUT["MAX_TENSORS"] a constant.
"""
from __future__ import annotations

import enum

from .. import _core

LAYOUT: dict[str, int] = _core.layout()
now_ns = _core.now_ns  # CLOCK_MONOTONIC, the clock of every timestamp in a slot
PROTOCOL_VERSION = LAYOUT["PROTOCOL_VERSION"]
MAX_TENSORS = LAYOUT["MAX_TENSORS"]
MAX_DIMS = LAYOUT["MAX_DIMS"]
NAME_BYTES = LAYOUT["NAME_BYTES"]
ERROR_BYTES = LAYOUT["ERROR_BYTES"]
DATA_ALIGN = LAYOUT["DATA_ALIGN"]
MAX_BATCH_REQUESTS = LAYOUT["MAX_BATCH_REQUESTS"]
MAILBOX_RETIRED = LAYOUT["MAILBOX_RETIRED"]
SLOT_BYTES = LAYOUT["slot.size"]
def clip_error(message: str, limit: int = ERROR_BYTES - 1) -> str:
    """An error message that fits a slot's error field, cut on a UTF-8 character boundary."""
    if 4 * len(message) <= limit:  # fits whatever it holds (at most 4 bytes a character)
        return message  # the common case: every answer of a batch that succeeded has ""
    return message.encode()[:limit].decode(errors="ignore")


TensorRef = _core.TensorRef  # (index, dtype, offset, nbytes, shape) + memory_kind, device_id

_ENUMS = _core.enums()
# One IntEnum per X-macro list of the header; the names are the header's short names.
DataType = enum.IntEnum("DataType", _ENUMS["DataType"], module=__name__)
Status = enum.IntEnum("Status", _ENUMS["Status"], module=__name__)
SlotState = enum.IntEnum("SlotState", _ENUMS["SlotState"], module=__name__)
Timestamp = enum.IntEnum("Timestamp", _ENUMS["Timestamp"], module=__name__)
ServerState = enum.IntEnum("ServerState", _ENUMS["ServerState"], module=__name__)
ClientState = enum.IntEnum("ClientState", _ENUMS["ClientState"], module=__name__)
MailboxState = enum.IntEnum("MailboxState", _ENUMS["MailboxState"], module=__name__)
MemoryKind = enum.IntEnum("MemoryKind", _ENUMS["MemoryKind"], module=__name__)
RingResult = enum.IntEnum("RingResult", _ENUMS["RingResult"], module=__name__)
PopResult = enum.IntEnum("PopResult", _ENUMS["PopResult"], module=__name__)
Duration = enum.IntEnum("Duration", _ENUMS["Duration"], module=__name__)
FailureReason = enum.IntEnum("FailureReason", _ENUMS["FailureReason"], module=__name__)
Wake = enum.IntEnum("Wake", _ENUMS["Wake"], module=__name__)
