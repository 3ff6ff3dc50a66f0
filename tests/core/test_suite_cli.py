"""The suites' shared command-line plumbing: flags and help text derived from a dataclass config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from mindspeed.suite_cli import add_dataclass_flags, field_help


@dataclass
class _Config:
    """A config.

    Attributes:
        load_dir: where to read from,
            over two lines.
        ratio: a share in %.
        fast: go fast.
        check: check the input.
        mode: how to run.
        count: how many.
    """

    load_dir: str
    ratio: float = 0.5
    fast: bool = False
    check: bool = True
    mode: str = "a"
    count: int | None = None


def test_field_help_joins_lines_and_escapes_percent() -> None:
    helps = field_help(_Config)
    assert helps["load_dir"] == "where to read from, over two lines."
    assert helps["ratio"] == "a share in %%."
    assert set(helps) == {"load_dir", "ratio", "fast", "check", "mode", "count"}


def test_dataclass_flags_parse_into_the_config() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_flags(parser, _Config, {"mode": ("a", "b")})
    args = parser.parse_args(["--load-dir", "x", "--ratio", "0.25", "--fast", "--no-check", "--count", "3"])
    assert _Config(**vars(args)) == _Config("x", 0.25, True, False, "a", 3)
    assert _Config(**vars(parser.parse_args(["--load-dir", "x"]))) == _Config("x")
    assert "(default 0.5)" in parser.format_help() and "a share in %." in parser.format_help()
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--load-dir", "x", "--mode", "c"])
