"""The quiet console: detail and other libraries' warnings go to the run log, on the console only when verbose."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from mindspeed.log import (
    DETAIL,
    PACKAGE_LOGGERS,
    THIRD_PARTY_LOGGERS,
    log_once,
    logged_as_detail,
    open_run_log,
    setup_logging,
)


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(name) for name in (*PACKAGE_LOGGERS, *THIRD_PARTY_LOGGERS)]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    with warnings.catch_warnings():  # restores warnings.showwarning too
        warnings.simplefilter("always")
        yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def _emit(tag: str) -> None:
    logger = logging.getLogger("mindspeed.test_log")
    logger.info("step 1/2: loss 7.5")
    logger.info("  - cuda-api:current_device: a patch", extra=DETAIL)
    log_once(logger, f"kernel rms_norm: using 'native' on cpu ({tag})", detail=True)  # once per process
    with logged_as_detail("mindspeed.test_log.convert"):
        logging.getLogger("mindspeed.test_log.convert").warning("no config.json for the output")
    for _ in range(3):  # the same warning from three places is shown once
        warnings.warn_explicit("Apex is not installed", UserWarning, "megatron/core/a.py", 21)
    logging.getLogger("megatron.core.optimizer").warning("deprecated flag")
    logging.getLogger("megatron.core.optimizer").error("a real failure")
    logger.info("step 2/2: loss 7.1")


@pytest.mark.parametrize("verbose", [False, True])
def test_console_shows_detail_only_when_verbose_and_the_run_log_has_everything(
    tmp_path, restore_logging, verbose: bool
) -> None:
    console = io.StringIO()
    setup_logging("INFO", stream=console, verbose=verbose)
    logging.getLogger("mindspeed.test_log").info("before the run log opens")
    with open_run_log(tmp_path / "report.txt") as path:
        _emit(f"verbose={verbose}")
    assert path == tmp_path / "report.txt"
    shown, kept = console.getvalue(), path.read_text()
    always = ("step 1/2: loss 7.5", "step 2/2: loss 7.1", "a real failure")
    detail = (
        "cuda-api:current_device",
        "kernel rms_norm",
        "no config.json",
        "UserWarning: Apex is not installed",
        "deprecated flag",
    )
    assert all(text in shown for text in always)
    assert all((text in shown) == verbose for text in detail), shown
    assert all(text in kept for text in (*always, *detail, "before the run log opens")), kept
    assert kept.count("Apex is not installed") == 1 and shown.count("Apex is not installed") == int(verbose)
    assert len(kept.splitlines()) == 9  # one line per record: a warning too
