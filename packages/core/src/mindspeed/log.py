"""Rank-aware logging for the whole suite.

Library code gets a logger with :func:`get_logger` and never prints. Nothing is configured at
import time: an entry point (a CLI, a test, a user script) calls :func:`setup_logging` once,
which installs one handler on the ``mindspeed*`` loggers that prefixes every line with the
rank and, by default, drops INFO/DEBUG lines of ranks other than 0.
"""

from __future__ import annotations

import logging
import os
import sys

#: The top-level loggers of the four packages; suites log under their own import name.
PACKAGE_LOGGERS = ("mindspeed", "mindspeed_llm", "mindspeed_mm", "mindspeed_rl")
_HANDLER_NAME = "mindspeed-rank-handler"


def get_rank() -> int:
    """The global rank of this process: torch.distributed's if initialised, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # torch without distributed support
        pass
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (pass ``__name__``)."""
    return logging.getLogger(name)


class RankFilter(logging.Filter):
    """Adds ``record.rank`` and keeps only warnings and errors on ranks other than 0.

    Args:
        all_ranks: keep every record on every rank (for debugging a hang, say).
    """

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = get_rank()
        return self.all_ranks or record.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: str | int = "INFO", all_ranks: bool = False, stream=None) -> None:
    """Install the rank-aware handler on the package loggers; calling it again reconfigures.

    Args:
        level: threshold for the package loggers ("DEBUG", "INFO", ...).
        all_ranks: show INFO lines of every rank, not only rank 0.
        stream: where to write (default: standard error).
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RankFilter(all_ranks=all_ranks))
    handler.setFormatter(
        logging.Formatter("%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


_logged_once: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time it is seen for ``logger`` in this process."""
    key = (logger.name, message)
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)
