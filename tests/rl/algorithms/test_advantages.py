"""Advantage estimators against plain per-group loops (GRPO, Dr. GRPO, RLOO formulas)."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import ADVANTAGES, broadcast_to_tokens, compute_advantages

GROUP = 4


def _rewards() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    continuous = torch.rand(3 * GROUP, generator=gen)
    binary = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    identical = torch.full((GROUP,), 0.7)  # constant group: 0.7 is not exact in binary
    return torch.cat([continuous, binary, identical])


def _reference(rewards: list[float], name: str, eps: float = 1e-6) -> list[float]:
    out = []
    for start in range(0, len(rewards), GROUP):
        group = rewards[start : start + GROUP]
        mean = sum(group) / GROUP
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (GROUP - 1))
        for i, r in enumerate(group):
            if max(group) == min(group):
                out.append(0.0)
            elif name == "grpo":
                out.append((r - mean) / (std + eps))
            elif name == "grpo_no_std":
                out.append(r - mean)
            else:  # rloo: the mean of the other samples is the baseline
                out.append(r - sum(g for j, g in enumerate(group) if j != i) / (GROUP - 1))
    return out


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo"])
def test_estimators_equal_per_group_loops(name: str) -> None:
    rewards = _rewards()
    got = compute_advantages(name, rewards, GROUP)
    expected = torch.tensor(_reference(rewards.double().tolist(), name), dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std", "rloo"])
def test_identical_rewards_give_exactly_zero(name: str) -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    got = compute_advantages(name, rewards, GROUP)
    assert torch.equal(got, torch.zeros(12))
    assert torch.isfinite(got).all()


def test_grpo_binary_group_is_standardised() -> None:
    # One success in a group of 4: mean 1/4, sample std 1/2 -> +1.5 and -0.5 (eps aside).
    got = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 0.0]), GROUP, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_broadcast_over_masks_of_different_lengths() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    adv = torch.tensor([2.0, -1.0, 0.5, 3.0])
    got = compute_advantages("grpo_no_std", torch.tensor([1.0, 2.0, 3.0, 4.0]), 4, response_mask=mask)
    assert got.shape == (4, 4)
    for i, row in enumerate(mask.tolist()):
        for t, m in enumerate(row):
            assert got[i, t] == ((i + 1) - 2.5) * m
    torch.testing.assert_close(broadcast_to_tokens(adv, mask), adv[:, None] * mask)


def test_bad_input_names_the_problem() -> None:
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        compute_advantages("grpo", torch.ones(4), 1)
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages("grpo", torch.ones(4), 3)
    with pytest.raises(ValueError, match="Did you mean 'grpo'"):
        compute_advantages("grpoo", torch.ones(4), 2)
    assert {"grpo", "grpo_no_std", "rloo"} <= set(ADVANTAGES.keys())
