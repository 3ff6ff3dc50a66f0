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
