"""Unit tests of ``mindspeed.checkpointing.finite`` and the damage fault points (no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed.checkpointing import (
    FAULT_ENV,
    SkipCounter,
    agree_any,
    fault_armed,
    first_nonfinite,
    first_nonfinite_everywhere,
    plant_nan,
    refused_save,
)

pytestmark = pytest.mark.faults


def test_first_nonfinite_names_the_first_bad_tensor() -> None:
    good, bad, inf = torch.ones(3), torch.ones(4), torch.zeros(2)
    plant_nan(bad)
    inf[1] = math.inf
    assert math.isnan(bad[0]) and bad[1:].eq(1).all()
    assert first_nonfinite([("a", good), ("b", bad), ("c", inf)]) == "b"
    assert first_nonfinite([("a", good), ("steps", torch.tensor([3])), ("c", inf)]) == "c"
    assert first_nonfinite([("a", good), ("empty", torch.empty(0)), ("ids", torch.arange(3))]) is None
    # Without a process group the agreed answer is the local one.
    assert first_nonfinite_everywhere([("b", bad)]) == "b" and agree_any(True) and not agree_any(False)


def test_damage_points_are_armed_at_their_step_or_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not fault_armed("train.grad_nan", 3)
    monkeypatch.setenv(FAULT_ENV, "train.grad_nan@3")
    assert [fault_armed("train.grad_nan", s) for s in (2, 3, 4)] == [False, True, False]
    assert not fault_armed("save.param_nan", 3)
    monkeypatch.setenv(FAULT_ENV, "train.grad_nan@3+")
    assert [fault_armed("train.grad_nan", s) for s in (2, 3, 4)] == [False, True, True]
    monkeypatch.setenv(FAULT_ENV, "train.step_end@3=SIGTERM")
    assert not fault_armed("train.grad_nan", 3)


def test_skip_counter_lines_and_limit() -> None:
    skips = SkipCounter(2)
    skips.record(applied=False, diverged=True)
    assert (skips.skipped, skips.streak, skips.exhausted()) == (1, 1, False)
    assert skips.skip_line(3, 4.25, math.nan).startswith("step 3: gradient norm is nan (loss 4.2500); step skipped")
    assert skips.skip_line(3, math.inf, None).startswith("step 3: loss is inf;")
    skips.record(applied=True, diverged=False)
    assert (skips.skipped, skips.streak) == (1, 0)
    skips.record(applied=False, diverged=True)
    skips.record(applied=False, diverged=True)
    assert skips.exhausted() and skips.skipped == 3
    line = skips.stop_line(7, 1e-2, "it resumes from runs/x/iter_0000006")
    assert line == (
        "2 consecutive steps with a non-finite loss or gradient norm (train.max_nonfinite_steps=2), the last at "
        "step 7: the run diverged; lower train.lr (now 0.01) and run the same command: it resumes from "
        "runs/x/iter_0000006"
    )
    # An fp16 loss-scale overflow is skipped but is no divergence: it ends the streak.
    skips.record(applied=False, diverged=False)
    assert (skips.skipped, skips.streak) == (4, 0)
    assert "no complete checkpoint was written before it" in refused_save("r/iter_2", "parameter w", None)
