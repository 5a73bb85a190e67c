"""Errors of Triton's python model API, and their mapping to shmserve's statuses."""
from __future__ import annotations

from ..protocol import Status


class TritonError:
    """pb_utils.TritonError(message, code=TritonError.INTERNAL): an error a response
    carries (InferenceResponse(error=...)), not an exception."""

    # Triton's TRITONSERVER_Error codes as pb_utils names them
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    __slots__ = ("_message", "_code")

    def __init__(self, message: str, code: int = INTERNAL):
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class TritonModelException(Exception):
    """pb_utils.TritonModelException: what the API raises to model code."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class NotImplementedByShmserve(TritonModelException, NotImplementedError):
    """A part of Triton's python model API that shmserve does not implement: raised
    where it is used, naming it, so that nothing silently does less than in Triton."""

    def __init__(self, feature: str, why: str = ""):
        super().__init__(f"{feature} is not implemented by shmserve's python backend"
                         + (f" ({why})" if why else ""))


def unsupported(feature: str, why: str = ""):
    """A callable that raises NotImplementedByShmserve naming `feature`."""
    def refuse(*args, **kwargs):
        raise NotImplementedByShmserve(feature, why)
    refuse.__name__ = feature.rsplit(".", 1)[-1].removesuffix("()")
    refuse.__doc__ = f"Not implemented by shmserve: raises NotImplementedByShmserve. {why}"
    return refuse


# TritonError code <-> shmserve status (the slot carries a status and a message)
_STATUS_OF = {TritonError.INVALID_ARG: Status.INVALID_ARG, TritonError.NOT_FOUND: Status.NOT_FOUND,
              TritonError.UNAVAILABLE: Status.UNAVAILABLE}
_CODE_OF = {Status.INVALID_ARG: TritonError.INVALID_ARG, Status.NOT_FOUND: TritonError.NOT_FOUND,
            Status.UNAVAILABLE: TritonError.UNAVAILABLE, Status.BUSY: TritonError.UNAVAILABLE,
            Status.SERVER_DEAD: TritonError.UNAVAILABLE, Status.TIMEOUT: TritonError.UNAVAILABLE}


def status_of(error: TritonError) -> Status:
    return _STATUS_OF.get(error.code(), Status.INTERNAL)


def code_of(status: int) -> int:
    return _CODE_OF.get(status, TritonError.INTERNAL)
