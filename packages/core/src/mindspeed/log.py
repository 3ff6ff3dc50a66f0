"""Rank-aware logging for the whole suite.

Library code gets a logger with :func:`get_logger` and never prints. Nothing is configured at
import time: an entry point (a CLI, a test, a user script) calls :func:`setup_logging` once,
which installs one handler on the ``mindspeed*`` loggers that prefixes every line with the
rank and, by default, drops INFO/DEBUG lines of ranks other than 0.

The console is kept for what a user reads (the loss lines, where things were written). Records
logged with ``extra=DETAIL`` (the adaptor's patch list, the features table, kernel choices) and
other libraries' warnings (``warnings.warn``, megatron-core's and torch's loggers; each distinct
one once) are *detail*: they go to the run's log file (:func:`open_run_log`, buffered until a
run opens one) and reach the console only when verbose (``--verbose``, or ``MINDSPEED_VERBOSE=1``,
which spawned ranks inherit). So are the Hugging Face libraries' progress bars (transformers'
``Loading weights``, ``Writing model shards``): a console that is not verbose does not draw them
(the suites log what was loaded or written as detail instead).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

#: The top-level loggers of the four packages; suites log under their own import name.
PACKAGE_LOGGERS = ("mindspeed", "mindspeed_llm", "mindspeed_mm", "mindspeed_rl")
_HANDLER_NAME = "mindspeed-rank-handler"
_RUN_LOG_NAME = "mindspeed-run-log"
#: ``logger.info(msg, extra=DETAIL)``: the run's log file gets the record, the console only when verbose.
DETAIL = {"detail": True}
#: Loggers of other libraries whose warnings are detail (``py.warnings`` carries ``warnings.warn``).
THIRD_PARTY_LOGGERS = ("py.warnings", "megatron", "torch.utils.cpp_extension")
#: The run log's file name in a run's output directory (the full log, detail included).
RUN_LOG_FILE = "report.txt"
#: huggingface_hub's switch for its progress bars and transformers' (read when they are imported).
HUB_PROGRESS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
#: Set to 1 for a verbose console (the CLIs' ``--verbose``); spawned ranks inherit it.
VERBOSE_ENV = "MINDSPEED_VERBOSE"
_FORMAT = logging.Formatter("%(asctime)s [rank%(rank)s] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")


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


class ConsoleFilter(logging.Filter):
    """Drops detail records (``extra=DETAIL``, other libraries' warnings) unless ``verbose``."""

    def __init__(self, verbose: bool = False) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        return self.verbose or not getattr(record, "detail", False)


class ThirdPartyFilter(logging.Filter):
    """Marks another library's records below ERROR as detail and lets each distinct message pass once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "dedup_key", None) or record.getMessage()
        if key in self.seen:
            return False
        self.seen.add(key)
        if record.levelno < logging.ERROR:
            record.detail = True
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (a test's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102 -- logging.StreamHandler's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class RunLogHandler(logging.Handler):
    """Every record, detail included, into the run's log file; kept in memory until one is open."""

    def __init__(self, capacity: int = 5000) -> None:
        super().__init__()
        self.set_name(_RUN_LOG_NAME)
        self.setFormatter(_FORMAT)
        self.addFilter(RankFilter())
        self.pending: collections.deque[logging.LogRecord] = collections.deque(maxlen=capacity)
        self.file = None
        self.path: Path | None = None
        self.failed = False  # the file could not be written: records are dropped
        self._warned_stop = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        if self.file is None:
            self.pending.append(record)
            return
        try:
            self.file.write(self.format(record) + "\n")
            self.file.flush()
        except Exception:  # noqa: BLE001 -- logging must not raise
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging.Handler's name
        """A file that cannot be written (a full disk): one warning, then the run log is no longer written.

        ``logging``'s own handler prints a traceback per record: hundreds on a full disk.
        """
        err = sys.exc_info()[1]
        self.failed = True  # first: the warning below must not come back here
        stop_writing(self, f"cannot write the run log {self.path}: {err}; it is not written any more")
        file, self.file = self.file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def open(self, path: Path) -> None:
        """Write to ``path`` (appended to): first what was kept, then every record."""
        self.failed = self._warned_stop = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file, self.path = open(path, "a", encoding="utf-8"), path
        except OSError as err:
            self.path = path
            self.pending.clear()
            self.failed = True
            stop_writing(self, f"cannot write the run log {path}: {err}; it is not written")
            return
        while self.pending:
            self.emit(self.pending.popleft())

    def close_file(self) -> None:
        """Stop writing to the file (records are kept in memory again)."""
        if self.file is not None:
            with contextlib.suppress(OSError):  # a full disk: the warning was given when a write failed
                self.file.close()
        self.file, self.path, self.failed = None, None, False


def stop_writing(sink: object, message: str) -> None:
    """Warn once per ``sink`` (a log file, the metrics writer) that it cannot be written any more.

    The caller stops writing to it: a full disk costs one line, not a traceback per record.
    """
    if getattr(sink, "_warned_stop", False):
        return
    with contextlib.suppress(AttributeError):
        sink._warned_stop = True  # type: ignore[attr-defined]
    logging.getLogger(__name__).warning("%s", message)


#: The process's run-log handler (shared by every logger setup_logging configures).
_run_log = RunLogHandler()


def is_verbose() -> bool:
    """Whether the console shows detail (``MINDSPEED_VERBOSE=1``)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def setup_logging(level: str | int = "INFO", all_ranks: bool = False, stream=None, verbose: bool | None = None) -> None:
    """Install the rank-aware handler on the package loggers; calling it again reconfigures.

    Also routes other libraries' warnings (:data:`THIRD_PARTY_LOGGERS`, ``warnings.warn``) through
    the same handlers as detail, each distinct one once.

    Args:
        level: threshold for the package loggers ("DEBUG", "INFO", ...).
        all_ranks: show INFO lines of every rank, not only rank 0.
        stream: where to write (default: standard error at the time of each record).
        verbose: show detail records on the console (default: :func:`is_verbose`).
    """
    verbose = is_verbose() if verbose is None else verbose
    _run_log.pending.clear()  # the next run log starts from this configuration
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RankFilter(all_ranks=all_ranks))
    handler.addFilter(ConsoleFilter(verbose))
    handler.setFormatter(_FORMAT)
    for name in PACKAGE_LOGGERS:
        _install(logging.getLogger(name), handler, _run_log)
        logging.getLogger(name).setLevel(level)
    third_party = _ForwardHandler(handler, _run_log)
    for name in THIRD_PARTY_LOGGERS:
        _install(logging.getLogger(name), third_party)
    warnings.showwarning = _show_warning
    if not verbose:
        hide_hub_progress_bars()


def hide_hub_progress_bars() -> None:
    """Turn off the Hugging Face libraries' progress bars (console noise unless verbose).

    Sets ``HF_HUB_DISABLE_PROGRESS_BARS=1`` (unless the user set it), which huggingface_hub and
    transformers read when imported (spawned ranks inherit it), and switches the bars off in
    transformers and diffusers if they are imported already. Imports neither.
    """
    os.environ.setdefault(HUB_PROGRESS_ENV, "1")
    if os.environ[HUB_PROGRESS_ENV].strip().lower() not in ("1", "true", "yes", "on"):
        return  # the user asked for the bars
    for name in ("transformers.utils.logging", "diffusers.utils.logging"):
        module = sys.modules.get(name)
        if module is not None:
            module.disable_progress_bar()
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        hub.disable_progress_bars()


class _ForwardHandler(logging.Handler):
    """Marks (and thins out) another library's records, then hands them to our handlers."""

    def __init__(self, *targets: logging.Handler) -> None:
        super().__init__()
        self.set_name(_HANDLER_NAME)
        self.addFilter(ThirdPartyFilter())
        self.targets = targets

    def emit(self, record: logging.LogRecord) -> None:
        for target in self.targets:
            target.handle(record)


def _install(logger: logging.Logger, *handlers: logging.Handler) -> None:
    for old in [h for h in logger.handlers if h.get_name() in (_HANDLER_NAME, _RUN_LOG_NAME)]:
        logger.removeHandler(old)
    for handler in handlers:
        logger.addHandler(handler)
    logger.propagate = False


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning``: one log line on ``py.warnings`` (a detail record, once per text)."""
    text = f"{category.__name__}: {str(message).strip()}"
    logging.getLogger("py.warnings").warning("%s (%s:%d)", text, filename, lineno, extra={"dedup_key": text})


@contextlib.contextmanager
def open_run_log(path: str | Path) -> Iterator[Path | None]:
    """Write the log of a run, detail included, to ``path`` for the ``with`` block (rank 0 only).

    What was logged before (since :func:`setup_logging` or the last run log) is written first, so the adaptor's
    patch list and the warnings of imports are in it too. Inside another run log's block this
    one changes nothing (the outer file keeps everything). Yields the file being written, or
    ``None`` on other ranks.
    """
    if get_rank() != 0:
        yield None
        return
    if _run_log.file is not None:
        yield _run_log.path
        return
    _run_log.open(Path(path))
    try:
        yield Path(path)
    finally:
        _run_log.close_file()


_logged_once: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO, detail: bool = False) -> None:
    """Log ``message`` the first time it is seen for ``logger`` in this process (as detail if asked)."""
    key = (logger.name, message)
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message, extra=DETAIL if detail else None)


def run_log_path() -> Path | None:
    """The run log being written (:func:`open_run_log`), if any."""
    return _run_log.path


class _MarkDetail(logging.Filter):
    def __init__(self, below: int = logging.ERROR) -> None:
        super().__init__()
        self.below = below

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.below:
            record.detail = True
        return True


@contextlib.contextmanager
def logged_as_detail(*names: str, errors: bool = False) -> Iterator[None]:
    """Inside the block, records below ERROR of the loggers ``names`` (these exact loggers) are detail.

    For a step a command runs on the user's behalf whose own report is not what the user asked
    for (the trainer's Hugging Face export runs a whole checkpoint conversion). ``errors``: the
    ERROR records too (a failure the caller reports in its own words, e.g. a full disk).
    """
    mark = _MarkDetail(logging.CRITICAL + 1 if errors else logging.ERROR)
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(mark)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(mark)
