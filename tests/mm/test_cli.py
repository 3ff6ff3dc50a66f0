"""The ``mindspeed-mm`` entry point: installed, versioned, helpful without arguments."""

from __future__ import annotations

import importlib.metadata
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
