"""A diverged step never reaches the weights or a checkpoint (real ``mindspeed-llm pretrain`` runs).

- ``save.param_nan@4``: a NaN in a parameter when step 4 is saved (what an update that escaped
  the step's check, or a bit flip, would leave): the save is refused before anything is
  written, with exit 1 and one line naming the previous complete checkpoint; ``iter_0000002``
  stays the resume point, and the same command resumes from it to the uninterrupted run's
  numbers bit for bit.
- ``train.grad_nan@3+`` with ``train.max_nonfinite_steps=2``: from step 3 on a NaN gradient
  behind a finite loss; steps 3 and 4 are skipped with one warning line each, and the run
  stops after step 4 with exit 1 and one line naming the step, ``train.lr`` and the checkpoint
  it resumes from; no checkpoint written by the run holds a NaN.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import TRACKER, list_complete
from mindspeed.metrics.log import read_metrics
from tests.reliability import harness

pytestmark = [pytest.mark.faults, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]


def _nonfinite(step_dir: Path, tmp: Path) -> list[str]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    state = torch.load(file, weights_only=False)
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()]


def test_a_save_with_a_nan_parameter_is_refused_and_the_run_resumes(
    tmp_path: Path, dataset: str, reference: Path
) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out))
    done = harness.run(args, fault="save.param_nan@4")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.lines("not written")
    assert f"checkpoint {out / 'iter_0000004'} not written: parameter " in line, line
    assert f"the newest complete checkpoint {out / 'iter_0000002'} stays the resume point" in line, line
    assert "lower train.lr" in line, line
    assert [p.name for p in out.glob("iter_*")] == ["iter_0000002"], "something of the refused save was left"
    assert (out / TRACKER).read_text().strip() == "2"
    again = harness.run(args)
    assert again.returncode == 0 and again.resumed_step == 2, again.stderr[-3000:]
    assert harness.numerics(out / "metrics.jsonl") == harness.numerics(reference / "metrics.jsonl")


def test_nan_gradients_are_skipped_and_stop_the_run(tmp_path: Path, dataset: str) -> None:
    out = tmp_path / "run"
    args = harness.command(*harness.recipe(dataset, out), "train.max_nonfinite_steps=2")
    done = harness.run(args, fault="train.grad_nan@3+")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    warnings = done.lines("step skipped")
    assert [w.split("step ")[1].split(":")[0] for w in warnings] == ["3", "4"], warnings
    assert all("gradient norm is nan" in w for w in warnings), warnings
    (line,) = done.lines("consecutive steps")
    assert "2 consecutive steps with a non-finite loss or gradient norm (train.max_nonfinite_steps=2)" in line
    assert "the last at step 4" in line and "lower train.lr (now 0.003)" in line, line
    assert f"it resumes from {out / 'iter_0000002'}" in line, line
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [
        (1, False, 0),
        (2, False, 0),
        (3, True, 1),
        (4, True, 2),
    ]
    assert records[2]["grad_norm"] == "nan" and records[2]["loss"] != "nan"
    assert records[3]["lr"] == records[2]["lr"], "the schedule advanced on a skipped step"
    assert [p.name for p in list_complete(out)] == ["iter_0000002"]
    assert _nonfinite(out / "iter_0000002", tmp_path) == []
