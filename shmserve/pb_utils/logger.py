"""pb_utils.Logger: model log lines into the server log, with file and line as
Triton writes them. VERBOSE lines show with --log-level DEBUG (Triton's --log-verbose)."""
from __future__ import annotations

import enum
import logging
import os
import sys

_log = logging.getLogger("shmserve.model")


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PYTHON_LEVEL = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
                 LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}


class Logger:
    LogLevel = LogLevel
    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, \
        LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        python_level = _PYTHON_LEVEL[LogLevel(level)]
        if not _log.isEnabledFor(python_level):
            return
        caller = sys._getframe(2 if sys._getframe(1).f_code.co_filename == __file__ else 1)
        _log.log(python_level, "%s %s:%d] %s", LogLevel(level).name[0],
                 os.path.basename(caller.f_code.co_filename), caller.f_lineno, message)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)
