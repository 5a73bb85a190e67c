"""pb_utils.Logger: model log lines into the server log (shmserve/logs.py), at the
file and line of the model code that logs, as Triton writes them, naming the model
instance as its print() lines do. VERBOSE lines show with --log-verbose (or
--log-level debug), as Triton's."""
from __future__ import annotations

import enum
import logging
import sys

_log = logging.getLogger("shmserve.model")
_who = ""  # "model 'm' version 1 instance 0: ", set by the python backend


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PYTHON_LEVEL = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
                 LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}


def bind(who: str) -> None:
    """Names the model instance in every line (the worker's python backend)."""
    global _who
    _who = f"{who}: " if who else ""


class Logger:
    LogLevel = LogLevel
    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, \
        LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        python_level = _PYTHON_LEVEL[LogLevel(level)]
        if not _log.isEnabledFor(python_level):
            return
        caller = sys._getframe(1)
        if caller.f_code.co_filename == __file__:  # log_info() and its kin
            caller = caller.f_back
        _log.handle(_log.makeRecord(_log.name, python_level, caller.f_code.co_filename,
                                    caller.f_lineno, "%s%s", (_who, message), None))

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
