"""One exception hierarchy for the whole product; status codes map to it here only."""
from __future__ import annotations

from . import protocol as P


class ShmServeError(Exception):
    """Base class. `code` is the protocol status (protocol.Status), `msg` the text."""

    code = P.Status.INTERNAL

    def __init__(self, msg: str, code: int | None = None):
        super().__init__(msg)
        self.msg = msg
        if code is not None:
            self.code = code


class InvalidArgumentError(ShmServeError):
    code = P.Status.INVALID_ARG


class ModelNotFoundError(ShmServeError):
    code = P.Status.NOT_FOUND


class UnavailableError(ShmServeError):
    code = P.Status.UNAVAILABLE


class OutputTooSmallError(ShmServeError):
    code = P.Status.OUTPUT_TOO_SMALL


class InternalError(ShmServeError):
    code = P.Status.INTERNAL


class BusyError(ShmServeError):
    code = P.Status.BUSY


class BadDescriptorError(ShmServeError):
    code = P.Status.BAD_DESCRIPTOR


class ServerDeadError(ShmServeError):
    """The server is gone (stopped or crashed) or ended this client's lease: no request
    of this client can be answered. Not retryable on this Client."""

    code = P.Status.SERVER_DEAD


class ServerTimeoutError(ShmServeError):
    """The caller's timeout expired before the answer came (the server may still be
    working on it)."""

    code = P.Status.TIMEOUT


class ConfigError(ShmServeError):
    """A model repository or config.pbtxt is wrong; the message names the file."""

    code = P.Status.INVALID_ARG


class ShmSpaceError(ShmServeError):
    """Not enough shared memory for a segment (/dev/shm for the named ones, memory for arenas)."""

    code = P.Status.UNAVAILABLE


_BY_CODE = {
    P.Status.INVALID_ARG: InvalidArgumentError,
    P.Status.NOT_FOUND: ModelNotFoundError,
    P.Status.UNAVAILABLE: UnavailableError,
    P.Status.OUTPUT_TOO_SMALL: OutputTooSmallError,
    P.Status.INTERNAL: InternalError,
    P.Status.BUSY: BusyError,
    P.Status.BAD_DESCRIPTOR: BadDescriptorError,
    P.Status.SERVER_DEAD: ServerDeadError,
    P.Status.TIMEOUT: ServerTimeoutError,
}


_BY_NAME = {cls.__name__: cls for cls in (ShmSpaceError, ConfigError, BusyError)}


def from_status(code: int, msg: str, type_name: str | None = None) -> ShmServeError:
    """The exception for a status read from a slot, or for a control-socket reply
    (which may also name the exception type for errors finer than a status)."""
    cls = _BY_NAME.get(type_name) or _BY_CODE.get(code, ShmServeError)
    return cls(msg, code)
