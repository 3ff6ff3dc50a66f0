"""REINFORCE++ / REINFORCE++-baseline, verl's clamped ``low_var_kl`` and Dr. GRPO's fixed length.

The references loop over responses and tokens with Python floats and share no code with the
implementation. REINFORCE++ (Hu 2025; verl ``compute_reinforce_plus_plus_outcome_advantage``,
OpenRLHF ``reinforce``): the per-token reward is ``-beta * kl_t`` plus the outcome reward at the
response's last token, the return is its discounted sum to the end of the response, and the
returns are whitened over every response token of the batch (mean, unbiased variance, ``+1e-8``).
The baseline variant (OpenRLHF ``reinforce_baseline``) subtracts the prompt group's mean outcome
reward first. Responses of different lengths are right-padded with garbage that must not count.
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import (
    KL_ESTIMATORS,
    TOKEN_ADVANTAGES,
    PolicyLossInputs,
    compute_policy_loss,
    compute_token_advantages,
    kl_penalty,
    policy_loss_config,
)

G = 3  # group size
LENGTHS = [4, 1, 6, 2, 6, 3]  # two prompts of three responses; the widest is 6
T = 7  # padded width (one column of padding everywhere)
REWARDS = [1.0, 0.0, 1.0, 0.5, 0.5, 0.0]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)
    kl = torch.rand(len(LENGTHS), T, generator=gen, dtype=torch.float64) * 0.5
    kl = torch.where(mask.bool(), kl, torch.full_like(kl, 123.0))  # garbage on padding
    return torch.tensor(REWARDS, dtype=torch.float64), mask, kl


def _reference(
    rewards: list[float], kl: list[list[float]], beta: float, gamma: float, baseline: bool
) -> list[list[float]]:
    if baseline:
        rewards = list(rewards)
        for start in range(0, len(rewards), G):
            mean = sum(rewards[start : start + G]) / G
            for i in range(start, start + G):
                rewards[i] -= mean
    returns: list[list[float]] = []
    for i, n in enumerate(LENGTHS):
        token_rewards = [-beta * kl[i][t] for t in range(n)]
        token_rewards[n - 1] += rewards[i]  # the outcome at the last (EOS) token
        row, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = token_rewards[t] + gamma * running
            row[t] = running
        returns.append(row)
    flat = [x for row in returns for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] + [0.0] * (T - len(row)) for row in returns]


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize(("beta", "gamma"), [(0.0, 1.0), (0.1, 1.0), (0.05, 0.9)])
def test_reinforce_plus_plus_equals_the_published_formula(baseline: bool, beta: float, gamma: float) -> None:
    rewards, mask, kl = _inputs()
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    token_rewards = -beta * kl if beta else None
    got = compute_token_advantages(name, rewards, mask, G, token_rewards, gamma)
    want = torch.tensor(_reference(REWARDS, kl.tolist(), beta, gamma, baseline), dtype=torch.float64)
    assert got.shape == (len(LENGTHS), T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert bool((got[~mask.bool()] == 0).all())  # padding: exactly 0
    # Whitened over the batch: mean 0, unbiased std 1 (up to the 1e-8) over the response tokens.
    picked = got[mask.bool()]
    assert abs(float(picked.mean())) < 1e-12 and abs(float(picked.std()) - 1) < 1e-6


def test_reinforce_plus_plus_details() -> None:
    rewards, mask, _ = _inputs()
    assert set(TOKEN_ADVANTAGES.keys()) == {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    # The baseline changes the result (prompt 0's mean is 2/3): not just a relabelled REINFORCE++.
    plain = compute_token_advantages("reinforce_plus_plus", rewards, mask, G)
    base = compute_token_advantages("reinforce_plus_plus_baseline", rewards, mask, G)
    assert not torch.allclose(plain, base)
    # All-equal groups without a KL term carry no signal: exactly 0, never NaN.
    flat = torch.full((6,), 0.7, dtype=torch.float64)
    assert bool((compute_token_advantages("reinforce_plus_plus_baseline", flat, mask, G) == 0).all())
    assert bool((compute_token_advantages("reinforce_plus_plus", flat, mask, G) == 0).all())
    with pytest.raises(ValueError, match="no tokens"):
        compute_token_advantages("reinforce_plus_plus", rewards, torch.zeros(6, T), G)
    with pytest.raises(ValueError, match="reinforce_plus_plus"):
        compute_token_advantages("reinforce", rewards, mask, G)


def _verl_low_var_kl(logp: float, ref_logp: float) -> float:
    """verl's ``kl_penalty(..., "low_var_kl")`` written out: clamp the log-ratio, k3, clamp the estimate."""
    kl = min(max(ref_logp - logp, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1, -10.0), 10.0)


def test_low_var_kl_is_verls_clamped_estimator() -> None:
    # A log-ratio of 99 in fp32: k3 overflows (inf value, inf gradient), low_var_kl stays finite.
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -100.0])
    value = kl_penalty(logp, ref, "low_var_kl")
    value.sum().backward()
    assert bool(torch.isfinite(value).all()) and bool(torch.isfinite(logp.grad).all())
    assert value.tolist() == [10.0, pytest.approx(_verl_low_var_kl(-1.0, -100.0))]
    assert math.isinf(float(kl_penalty(logp.detach(), ref, "k3")[0]))  # k3 stays k3 (unclamped)
    # Inside the range it is k3; everywhere it equals verl's formula.
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(200, generator=gen, dtype=torch.float64) * 30
    ref = -torch.rand(200, generator=gen, dtype=torch.float64) * 30
    got = kl_penalty(logp, ref, "low_var_kl")
    want = torch.tensor([_verl_low_var_kl(a, b) for a, b in zip(logp.tolist(), ref.tolist())], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inside = (kl_penalty(logp, ref, "k3") < 10).logical_and((ref - logp).abs() < 20)
    assert 0 < int(inside.sum()) < 200  # both regimes are exercised
    torch.testing.assert_close(got[inside], kl_penalty(logp, ref, "k3")[inside], rtol=0, atol=0)
    assert KL_ESTIMATORS.get("low_var_kl") is not KL_ESTIMATORS.get("k3")


def test_seq_mean_token_sum_norm_divides_by_the_configured_length() -> None:
    """The loss of a batch does not depend on its widest response: sum of token losses / norm_length."""
    gen = torch.Generator().manual_seed(2)
    lengths, norm = [3, 1, 2], 8
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths], dtype=torch.float64)
    logp = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    config = policy_loss_config("ppo_clip", loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.0, norm_length=norm)

    def loss(width: int, cfg=config) -> float:  # the same responses padded to another width
        pad = width - 4

        def widen(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, pad))

        inputs = PolicyLossInputs(logp=widen(logp), old_logp=widen(old), advantages=adv, mask=widen(mask))
        return float(compute_policy_loss("ppo_clip", inputs, cfg).loss)

    want = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            ratio = math.exp(float(logp[i, t] - old[i, t]))
            a = float(adv[i])
            want += max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)) / norm
    want /= len(lengths)
    assert loss(4) == pytest.approx(want, rel=1e-12) and loss(7) == pytest.approx(want, rel=1e-12)
    unset = policy_loss_config("ppo_clip", loss_agg_mode="seq-mean-token-sum-norm", kl_coef=0.0)
    assert loss(4, unset) != pytest.approx(loss(7, unset))  # without it: the padded width, batch by batch
    with pytest.raises(ValueError, match="norm_length"):
        policy_loss_config("ppo_clip", norm_length=0).validate()
