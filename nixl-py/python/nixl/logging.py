# SPDX-License-Identifier: Apache-2.0
"""``nixl.logging``: NIXL's logging helpers. Loggers are children of ``"nixl"``;
``NIXL_LOG_LEVEL`` (TRACE, DEBUG, INFO, WARN, ERROR, FATAL) sets its level. nixl-rs'
own Rust log goes to stderr, filtered by ``NIXL_RS_LOG``; its Python layer logs on
``"nixl_rs"``."""

from __future__ import annotations

import logging as _logging
import logging.config as _config
import os as _os

LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "simpleFormatter": {
            "format": "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s",
            "datefmt": "%Y-%m-%d %H:%M:%S",
        }
    },
    "handlers": {
        "consoleHandler": {
            "class": "logging.StreamHandler",
            "level": "INFO",
            "formatter": "simpleFormatter",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {"nixl": {"level": "INFO", "handlers": ["consoleHandler"], "propagate": False}},
}

_LEVELS = {"TRACE": _logging.DEBUG, "DEBUG": _logging.DEBUG, "INFO": _logging.INFO,
           "WARN": _logging.WARNING, "WARNING": _logging.WARNING, "ERROR": _logging.ERROR,
           "FATAL": _logging.CRITICAL}
_configured = False


def set_log_level_by_env(nixl_logger: _logging.Logger) -> None:
    """Set ``nixl_logger``'s level from ``NIXL_LOG_LEVEL``, if set."""
    value = _os.getenv("NIXL_LOG_LEVEL")
    if not value:
        return
    level = _LEVELS.get(value.upper())
    if level is None:
        nixl_logger.warning("Invalid NIXL_LOG_LEVEL value '%s'. Using configuration default.", value)
        return
    nixl_logger.setLevel(level)


def setup_logging() -> None:
    """Configure the ``"nixl"`` logger once (as NIXL does)."""
    global _configured
    if _configured:
        return
    _config.dictConfig(LOGGING_CONFIG)
    set_log_level_by_env(_logging.getLogger("nixl"))
    _configured = True


def get_logger(name: str) -> _logging.Logger:
    """The logger ``nixl.<name>`` (leading underscores dropped)."""
    setup_logging()
    return _logging.getLogger(f"nixl.{name.lstrip('_')}")


__all__ = ["LOGGING_CONFIG", "get_logger", "set_log_level_by_env", "setup_logging"]
