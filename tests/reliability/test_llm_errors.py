"""A checkpoint that cannot be used is one line on standard error and exit status 2, naming the input and the fix.

The command runs in this process (``mindspeed-llm`` 's ``main``), against the reference run's
checkpoints: a damaged one named explicitly, a save directory with no complete one, shapes
that differ from the recipe, another model family, and a directory that is no checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mindspeed_llm.cli import main
from tests.reliability import harness

pytestmark = pytest.mark.faults


def _error(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    code = main(["--log-level", "ERROR", "pretrain", *args])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("mindspeed-llm: error: ")]
    return line


def test_unusable_checkpoints_are_one_line_errors(
    tmp_path: Path, dataset: str, reference: Path, capsys: pytest.CaptureFixture
) -> None:
    fresh = str(tmp_path / "fresh")
    base = harness.recipe(dataset, tmp_path / "unused")
    newest = reference / "iter_0000010"

    # A damaged checkpoint named explicitly: the file, and the complete one next to it.
    copies = tmp_path / "copies"
    shutil.copytree(reference / "iter_0000008", copies / "iter_0000008")
    shutil.copytree(newest, copies / "iter_0000010")
    shard = next((copies / "iter_0000010").glob("*.distcp"))
    shard.unlink()
    line = _error(capsys, [*base, f"checkpoint.save={fresh}", f"checkpoint.load={copies / 'iter_0000010'}"])
    assert f"file {shard.name} is missing" in line and f"{copies / 'iter_0000008'}: set checkpoint.load to it" in line

    # A save directory whose checkpoints are all damaged: never trained over silently.
    (copies / "iter_0000008" / "complete.json").unlink()
    line = _error(capsys, [*harness.recipe(dataset, copies)])
    assert "holds checkpoints but none is complete" in line and "checkpoint.resume=false" in line

    # Shapes that differ from the recipe: the parameter and both shapes.
    line = _error(capsys, [*base, f"checkpoint.save={fresh}", f"checkpoint.load={newest}", "model.hidden_size=32"])
    assert "has shape [" in line and "there and [" in line and "in this recipe" in line
    assert str(newest / "config.yaml") in line

    # Another model family (qk-layernorm makes the recipe a Qwen3).
    line = _error(capsys, [*base, f"checkpoint.save={fresh}", f"checkpoint.load={newest}", "model.qk_layernorm=true"])
    assert "holds a llama2 model and this recipe builds a qwen3 model" in line

    # A directory that is no checkpoint.
    line = _error(capsys, [*base, f"checkpoint.save={fresh}", f"checkpoint.load={Path(dataset).parent}"])
    assert "is not a checkpoint" in line and "checkpoint.load=" in line
