"""shmserve: a multiprocess, shared-memory inference server for co-located callers."""
from .client import Client, InferResult, StreamResponse
from .errors import (BadDescriptorError, BusyError, ConfigError, InternalError,
                     InvalidArgumentError, ModelNotFoundError, OutputTooSmallError,
                     ServerDeadError, ServerTimeoutError, ShmServeError, ShmSpaceError,
                     UnavailableError)

__version__ = "0.1.0"
__all__ = ["Client", "InferResult", "StreamResponse", "ShmServeError", "InvalidArgumentError",
           "ModelNotFoundError", "UnavailableError", "OutputTooSmallError", "InternalError", "BusyError",
           "BadDescriptorError", "ServerDeadError", "ServerTimeoutError", "ConfigError",
           "ShmSpaceError"]
