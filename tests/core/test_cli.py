"""``mindspeed``, the core's command line: the flags every command line of the project shares."""

from __future__ import annotations

import logging
import os

import pytest

from mindspeed.cli import main
from mindspeed.log import DETAIL, PACKAGE_LOGGERS, VERBOSE_ENV


@pytest.fixture
def restore_logging():
    # main() calls setup_logging(), which binds a handler to capsys's stream; undo it afterwards.
    loggers = [logging.getLogger(name) for name in PACKAGE_LOGGERS]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["--verbose", "info", "--json"], True),
        (["info", "--json", "--verbose"], True),  # anywhere on the line, as in the suites
        (["-v", "info", "--json"], True),
        (["info", "--json"], False),
    ],
)
def test_verbose_shows_the_detail_on_the_console(monkeypatch, capsys, restore_logging, argv, verbose) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert main(argv) == 0
    logging.getLogger("mindspeed.test_cli").info("a detail line", extra=DETAIL)
    assert ("a detail line" in capsys.readouterr().err) == verbose
    assert (VERBOSE_ENV in os.environ) == verbose  # the ranks a command spawns see it too
