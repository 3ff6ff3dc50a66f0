"""A diverged step never reaches the weights or a checkpoint of ``mindspeed-mm train`` (tiny Qwen2.5-VL, in this process).

- ``train.grad_nan@2``: a NaN gradient behind a finite loss at step 2 (rank 0, after the
  backward): the step is skipped with one warning line, the step-2 checkpoint's weights and
  AdamW moments equal step 1's bit for bit, the learning-rate schedule does not advance (step 3
  trains with step 2's rate) and the metrics count the skip.
- ``save.param_nan@4``: a NaN in a parameter when step 4 is saved: the save is refused before
  anything is written (exit 1, one line naming ``step_00000002``, the resume point);
  the same command resumes from step 2 to the uninterrupted run's numbers bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import FAULT_ENV, STEP, list_complete
from mindspeed.metrics.log import read_metrics
from tests.reliability import harness

pytestmark = [pytest.mark.faults]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread, as the other in-process MM runs: the same numerics as the reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _main(capsys: pytest.CaptureFixture, overrides: list[str], fault: str | None = None) -> tuple[int, str]:
    from mindspeed_mm.cli import main

    with pytest.MonkeyPatch.context() as patch:
        if fault is not None:
            patch.setenv(FAULT_ENV, fault)
        code = main(["--log-level", "WARNING", "train", *overrides])
    return code, capsys.readouterr().err


def _tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            flat[prefix] = value

    walk("", torch.load(file, weights_only=False))
    return flat


def test_mm_nan_gradient_is_skipped(tmp_path: Path, mm_model: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    code, err = _main(capsys, [*harness.mm_recipe(*mm_model, out), "checkpoint.interval=1"], "train.grad_nan@2")
    assert code == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if "step skipped" in line]
    assert len(warnings) == 1 and "step 2: gradient norm is nan" in warnings[0], warnings
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["skipped"], r["skipped_steps"]) for r in records] == [(False, 0), (True, 1), (False, 1), (False, 1)]
    assert records[1]["grad_norm"] == "nan" and math.isfinite(records[1]["loss"])
    assert records[2]["lr"] == records[1]["lr"] > records[3]["lr"], "the schedule advanced on the skipped step"
    before, after = _tensors(out / "step_00000001", tmp_path), _tensors(out / "step_00000002", tmp_path)
    assert set(before) == set(after) and any("exp_avg" in k for k in before), sorted(before)[:5]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"the skipped step changed {changed[:4]}"


def test_mm_save_with_a_nan_parameter_is_refused_and_the_run_resumes(
    tmp_path: Path, mm_model: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    reference, out = tmp_path / "reference", tmp_path / "run"
    assert _main(capsys, harness.mm_recipe(*mm_model, reference))[0] == 0
    code, err = _main(capsys, harness.mm_recipe(*mm_model, out), "save.param_nan@4")
    assert code == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if "not written" in line]
    assert f"checkpoint {out / 'step_00000004'} not written: parameter " in line, line
    assert f"the newest complete checkpoint {out / 'step_00000002'} stays the resume point" in line, line
    assert [p.name for p in out.glob("step_*")] == ["step_00000002"], "something of the refused save was left"
    code, err = _main(capsys, harness.mm_recipe(*mm_model, out))
    assert code == 0, err[-3000:]
    assert [p.name for p in list_complete(out, STEP)] == ["step_00000002", "step_00000004"]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")
