"""The ``mindspeed-llm`` entry point: installed, versioned, helpful without arguments."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from mindspeed_llm.cli import main


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mindspeed-llm {importlib.metadata.version('mindspeed-llm')}"
    assert main([]) == 0
    assert "usage: mindspeed-llm" in capsys.readouterr().out


def test_unknown_command_fails_cleanly() -> None:
    out = subprocess.run([sys.executable, "-m", "mindspeed_llm.cli", "no-such-command"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


@pytest.mark.parametrize(
    "verb, options",
    [
        ("pretrain", ["--config", "r.yaml", "--nproc-per-node", "2"]),
        ("sft", ["--config", "r.yaml", "--nproc-per-node", "2"]),
        ("dpo", ["--config", "r.yaml", "--print-config"]),
        ("quickstart", ["--output-dir", "o", "--nproc-per-node", "2"]),
    ],
)
def test_overrides_are_accepted_anywhere_on_the_line(verb: str, options: list[str]) -> None:
    from mindspeed.suite_cli import parse_suite_args
    from mindspeed_llm.cli import build_parser

    line = [verb, "a.b=1", *options[:2], "c.d=2", *options[2:], "e.f=3"]
    args = parse_suite_args(build_parser(), line)
    assert args.overrides == ["a.b=1", "c.d=2", "e.f=3"]
    with pytest.raises(SystemExit) as exit_info:  # what is not key=value is still refused
        parse_suite_args(build_parser(), [*line, "--no-such-flag"])
    assert exit_info.value.code == 2


def test_verbose_before_or_after_the_command() -> None:
    from mindspeed.suite_cli import parse_suite_args
    from mindspeed_llm.cli import build_parser

    for line in (["--verbose", "pretrain", "a=1"], ["pretrain", "a=1", "--verbose"], ["pretrain", "-v", "a=1"]):
        args = parse_suite_args(build_parser(), line)
        assert args.verbose and args.overrides == ["a=1"], line
    assert not parse_suite_args(build_parser(), ["pretrain", "a=1"]).verbose


def test_pretrain_takes_overrides_after_nproc(capsys) -> None:
    """The issue's line: ``--config X parallel.tp=2 --nproc-per-node 2 train.steps=5``."""
    from mindspeed_llm.training.quickstart import TINY_CPU_RECIPE

    assert (
        main(
            [
                "pretrain",
                "--config",
                str(TINY_CPU_RECIPE),
                "parallel.tp=2",
                "--nproc-per-node",
                "2",
                "train.steps=5",
                "--print-config",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "steps: 5" in out and "tp: 2" in out
