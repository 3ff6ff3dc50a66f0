"""The learning-rate schedule, step by step."""

from __future__ import annotations

import math

import pytest

from mindspeed_mm.config import MMTrainConfig
from mindspeed_mm.trainer.optim import lr_at


def test_warmup_then_decay() -> None:
    cosine = MMTrainConfig(steps=6, lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine")
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert [lr_at(cosine, s) for s in range(1, 7)] == pytest.approx(expected)
    linear = MMTrainConfig(steps=4, lr=1.0, lr_decay_style="linear")
    assert [lr_at(linear, s) for s in range(1, 5)] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert lr_at(MMTrainConfig(steps=1, lr=0.3), 1) == 0.3  # a one-step run trains
    assert lr_at(MMTrainConfig(steps=5, lr=0.3, lr_decay_style="constant", lr_warmup_steps=1), 4) == 0.3
