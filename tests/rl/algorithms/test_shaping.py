"""DAPO's overlong punishment and dynamic sampling, truncated importance weights."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import DynamicSampler, constant_groups, overlong_penalty, truncated_importance_weights


def test_overlong_penalty_equals_dapo_piecewise_formula() -> None:
    max_len, buffer, factor = 20, 8, 0.5
    lengths = torch.arange(0, 25)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    for n, value in zip(lengths.tolist(), got.tolist()):
        if n <= max_len - buffer:
            expected = 0.0
        elif n <= max_len:
            expected = ((max_len - buffer) - n) / buffer * factor
        else:
            expected = -factor
        assert value == pytest.approx(expected), n
    assert got[12].item() == 0.0 and got[20].item() == pytest.approx(-0.5) and got[16].item() == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 0)


def test_dynamic_sampling_drops_equal_groups_and_refills() -> None:
    sampler = DynamicSampler(target_groups=3, group_size=2, max_rounds=5)
    # round 0: groups 0 (all 1) and 2 (all 0) carry no signal.
    assert sampler.add(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])) == [1]
    assert not sampler.done
    assert sampler.add(torch.tensor([0.5, 0.5, 1.0, 0.0])) == [1]
    assert sampler.add(torch.tensor([0.0, 1.0, 1.0, 0.0, 0.2, 0.3])) == [0, 1, 2]
    assert sampler.done and sampler.add(torch.tensor([0.0, 1.0])) == []
    assert sampler.selection() == [(0, 1), (1, 1), (2, 0)]
    metrics = sampler.metrics()
    assert metrics["dynamic_sampling/rounds"] == 3 and metrics["dynamic_sampling/dropped_groups"] == 3
    assert metrics["dynamic_sampling/dropped_fraction"] == pytest.approx(3 / 8)


def test_dynamic_sampling_gives_up_after_max_rounds() -> None:
    sampler = DynamicSampler(target_groups=2, group_size=2, max_rounds=2)
    sampler.add(torch.ones(4))
    with pytest.raises(RuntimeError, match="0 of 2 groups.*after 2 rounds"):
        sampler.add(torch.zeros(4))


def test_constant_groups_and_importance_weights() -> None:
    assert constant_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), 2).tolist() == [True, False, True]
    old = torch.tensor([[-1.0, -0.5, -2.0]])
    rollout = torch.tensor([[-1.5, -0.4, -0.1]])
    got = truncated_importance_weights(old, rollout, cap=1.5)
    expected = [min(math.exp(o - r), 1.5) for o, r in zip(old[0].tolist(), rollout[0].tolist())]
    torch.testing.assert_close(got, torch.tensor([expected]))
    with pytest.raises(ValueError, match="at least 1"):
        truncated_importance_weights(old, rollout, cap=0.5)
