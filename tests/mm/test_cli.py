"""The ``mindspeed-mm`` entry point: installed, versioned, helpful without arguments."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from mindspeed_mm.cli import main


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mindspeed-mm {importlib.metadata.version('mindspeed-mm')}"
    assert main([]) == 0
    assert "usage: mindspeed-mm" in capsys.readouterr().out


def test_unknown_command_fails_cleanly() -> None:
    out = subprocess.run([sys.executable, "-m", "mindspeed_mm.cli", "no-such-command"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_base_dir_is_one_flag_and_the_old_spelling_is_deprecated(capsys) -> None:
    """convert, generate and evaluate name the base model directory ``--base-dir``; ``--hf-cfg-dir`` still works."""
    from mindspeed.suite_cli import parse_suite_args
    from mindspeed_mm.cli import build_parser

    parser = build_parser()
    for command in ("generate", "evaluate", "convert"):
        assert "--base-dir" in parser._subparsers._group_actions[0].choices[command].format_help()
    for command in ("generate", "evaluate"):
        new = parse_suite_args(parser, [command, "--load-dir", "ckpt", "--base-dir", "models/x"])
        assert new.base_dir == "models/x" and capsys.readouterr().err == ""
        old = parse_suite_args(parser, [command, "--load-dir", "ckpt", "--hf-cfg-dir", "models/x"])
        assert old.base_dir == "models/x"
        assert (
            capsys.readouterr().err == f"mindspeed-mm {command}: warning: --hf-cfg-dir is deprecated; use --base-dir\n"
        )
        assert parse_suite_args(parser, [command, "--load-dir", "ckpt"]).base_dir is None


def test_hugging_face_progress_bars_stay_off_a_quiet_console(tmp_path) -> None:
    """transformers' "Loading weights" / "Writing model shards" bars are detail: absent unless verbose."""
    script = (
        "import sys; from mindspeed.log import setup_logging; setup_logging(); "
        "from mindspeed_mm.models import family_of; from mindspeed_mm.models.loading import load_model; "
        "from mindspeed_mm.testing import write_tiny_model; "
        "d = write_tiny_model(sys.argv[1]); load_model(d, family_of(d))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "Loading weights" not in out.stderr and "Writing model shards" not in out.stderr, out.stderr
