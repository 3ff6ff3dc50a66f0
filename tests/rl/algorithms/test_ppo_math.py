"""PPO's math: GAE and returns, the KL controller, the clipped value loss, the explained variance.

Every reference below is a plain Python loop over responses and tokens (floats, no tensors),
written from the formulas verl states in ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``AdaptiveKLController``, ``compute_value_loss``),
``verl/trainer/ppo/ray_trainer.py`` (``apply_kl_penalty``) and ``verl/trainer/ppo/metric_utils.py``
(``critic/vf_explained_var``); verl is not installed, so its formulas are written out here.
Responses have unequal lengths and are right-padded with garbage (inf, NaN, 1e6) that must not
count; one ends at the padded width (no padding), one is a single token.
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import (
    KL_CONTROLLERS,
    VALUE_ADVANTAGES,
    VALUE_LOSSES,
    AdaptiveKLController,
    ValueLossInputs,
    apply_kl_penalty,
    build_kl_controller,
    compute_value_advantages,
    compute_value_loss,
    explained_variance,
)

LENGTHS = [5, 1, 7, 3, 7, 2]  # the padded width is 7: two responses fill it (EOS at the last column)
T = 7


def _garbage(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with inf, -inf, NaN and 1e6 on the padding."""
    choices = torch.tensor([math.inf, -math.inf, math.nan, 1e6], dtype=x.dtype)
    pick = torch.randint(0, 4, x.shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(mask.bool(), x, choices[pick])


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)
    token_rewards = torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64) * 0.3
    values = torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64)
    return _garbage(token_rewards, mask, seed + 1), _garbage(values, mask, seed + 2), mask, gen


def _gae_loop(rewards: list[list[float]], values: list[list[float]], gamma: float, lam: float):
    """Textbook GAE per response over its own tokens: delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0."""
    advantages, returns = [], []
    for i, n in enumerate(LENGTHS):
        adv = [0.0] * n
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[i][t + 1] if t + 1 < n else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + values[i][t] for t in range(n)])
    return advantages, returns


def _whiten_loop(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def _padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (T - len(row)) for row in rows], dtype=torch.float64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0)])
def test_gae_and_returns_equal_a_reverse_loop_over_every_response(gamma: float, lam: float) -> None:
    rewards, values, mask, _ = _batch()
    adv_want, ret_want = _gae_loop(rewards.tolist(), values.tolist(), gamma, lam)
    raw, returns = compute_value_advantages("gae", rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(raw, _padded(adv_want), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, _padded(ret_want), rtol=1e-12, atol=1e-12)
    whitened, returns2 = compute_value_advantages("gae", rewards, values, mask, gamma, lam)
    torch.testing.assert_close(whitened, _padded(_whiten_loop(adv_want)), rtol=1e-12, atol=1e-12)
    assert torch.equal(returns2, returns)  # the returns are never whitened
    for out in (raw, whitened, returns):
        assert bool(torch.isfinite(out).all()) and bool((out[~mask.bool()] == 0).all())  # padding: exactly 0
    if lam == 1.0 and gamma == 1.0:
        # lam = 1: the return is the plain sum of the rewards to come, whatever the critic says.
        sums = [[sum(rewards[i, t:n].tolist()) for t in range(n)] for i, n in enumerate(LENGTHS)]
        torch.testing.assert_close(returns, _padded(sums), rtol=1e-12, atol=1e-12)
    if lam == 0.0:  # lam = 0: the one-step TD error
        i, n = 0, LENGTHS[0]
        td = [float(rewards[i, t] + gamma * (values[i, t + 1] if t + 1 < n else 0) - values[i, t]) for t in range(n)]
        torch.testing.assert_close(raw[i, :n], torch.tensor(td, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_gae_skips_masked_positions_inside_a_response_as_verl() -> None:
    """A hole in the mask (a tool's observation) is passed over: V and A carry across it."""
    rewards = torch.tensor([[0.1, 0.2, 9.0, 0.3, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, -0.2, 7.0, 0.4, 0.1]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    # The same response without the hole: tokens 0, 1, 3, 4.
    r, v = [0.1, 0.2, 0.3, 1.0], [0.5, -0.2, 0.4, 0.1]
    adv, run = [0.0] * 4, 0.0
    for t in reversed(range(4)):
        run = r[t] + gamma * (v[t + 1] if t < 3 else 0.0) - v[t] + gamma * lam * run
        adv[t] = run
    raw, returns = VALUE_ADVANTAGES.get("gae")(rewards, values, mask, gamma, lam)
    want = torch.tensor([[adv[0], adv[1], 0.0, adv[2], adv[3]]], dtype=torch.float64)
    torch.testing.assert_close(raw, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        returns[0, [0, 1, 3, 4]],
        torch.tensor(adv, dtype=torch.float64) + torch.tensor(v, dtype=torch.float64),
        rtol=1e-12,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match=r"must all be \[batch, len\]"):
        VALUE_ADVANTAGES.get("gae")(rewards, values[:, :3], mask, gamma, lam)
    with pytest.raises(ValueError, match="gae"):
        compute_value_advantages("gea", rewards, values, mask)


def test_kl_penalty_and_the_adaptive_controller_follow_verls_rule() -> None:
    """Over several batches: rewards use beta before the update; beta *= 1 + clip(kl/target - 1, +-0.2) * n / horizon."""
    assert set(KL_CONTROLLERS.keys()) == {"fixed", "adaptive"}
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)
    outcome = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25], dtype=torch.float64)
    target, horizon, beta0 = 0.1, 40, 0.05
    adaptive = build_kl_controller("adaptive", beta0, target, horizon)
    fixed = build_kl_controller("fixed", beta0, target, horizon)
    beta_want, seen_errors = beta0, set()
    for scale in (0.02, 0.09, 0.11, 0.5, 0.0, 0.3):  # below, near, above and far above the target
        noise = 1 + 0.1 * (torch.rand(len(LENGTHS), T, generator=gen, dtype=torch.float64) - 0.5)
        kl = _garbage(scale * noise, mask, 7)
        out = apply_kl_penalty(outcome, kl, mask, adaptive)
        kept = apply_kl_penalty(outcome, kl, mask, fixed)
        # The reference: per-token reward -beta * kl, the outcome at the last token; KL = mean of per-response means.
        per_response = []
        for i, n in enumerate(LENGTHS):
            row = [-beta_want * float(kl[i, t]) for t in range(n)]
            row[-1] += float(outcome[i])
            torch.testing.assert_close(
                out.token_rewards[i, :n], torch.tensor(row, dtype=torch.float64), rtol=1e-12, atol=1e-12
            )
            assert bool((out.token_rewards[i, n:] == 0).all())
            per_response.append(sum(float(kl[i, t]) for t in range(n)) / n)
        current = sum(per_response) / len(per_response)
        assert out.kl == pytest.approx(current, rel=1e-12) and out.kl_coef == pytest.approx(beta_want, rel=1e-12)
        error = min(max(current / target - 1, -0.2), 0.2)
        seen_errors.add(round(error, 6) if abs(error) < 0.2 else error)
        beta_want *= 1 + error * len(LENGTHS) / horizon
        assert adaptive.value == pytest.approx(beta_want, rel=1e-12)
        assert fixed.value == beta0 and kept.kl_coef == beta0
    assert {-0.2, 0.2} <= seen_errors and len(seen_errors) >= 4  # both clips and the proportional regime
    # The coefficient survives a resume.
    restored = build_kl_controller("adaptive", 1.0, target, horizon)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value and isinstance(restored, AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl > 0 and horizon >= 1"):
        build_kl_controller("adaptive", 0.1, 0.0, 10)
    with pytest.raises(ValueError, match="adaptive"):
        build_kl_controller("pid", 0.1)


def _value_loss_loop(vpreds, values, returns, clip):
    """0.5 * token-mean of max((v - G)^2, (clip(v, v_old +- c) - G)^2); the clip fraction; the mean prediction."""
    total, clipped, count, vsum = 0.0, 0, 0, 0.0
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            v, old, g = vpreds[i][t], values[i][t], returns[i][t]
            vc = min(max(v, old - clip), old + clip)
            a, b = (v - g) ** 2, (vc - g) ** 2
            total += max(a, b)
            clipped += b > a
            count += 1
            vsum += v
    return 0.5 * total / count, clipped / count, vsum / count


def test_clipped_value_loss_equals_the_formula_elementwise() -> None:
    assert set(VALUE_LOSSES.keys()) == {"clipped", "mse"}
    _, values, mask, gen = _batch(seed=4)
    returns = _garbage(torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64), mask, 11)
    vpreds = values.nan_to_num(0.0, 0.0, 0.0) + torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64)
    vpreds = _garbage(vpreds, mask, 12).requires_grad_(True)
    clip = 0.5
    out = compute_value_loss("clipped", ValueLossInputs(vpreds, values, returns, mask), cliprange_value=clip)
    loss_want, frac_want, vmean_want = _value_loss_loop(
        vpreds.detach().tolist(), values.tolist(), returns.tolist(), clip
    )
    assert float(out.loss.detach()) == pytest.approx(loss_want, rel=1e-12)
    assert out.metrics["vf_loss"] == pytest.approx(loss_want, rel=1e-12)
    assert out.metrics["vf_clipfrac"] == pytest.approx(frac_want, rel=1e-12) and 0 < frac_want < 1
    assert out.metrics["vpred_mean"] == pytest.approx(vmean_want, rel=1e-12)
    # The gradient: (v - G) / count where the unclipped term is the max, 0 where the clipped one is
    # (and the prediction lies outside the clip range); 0 on padding, never NaN.
    out.loss.backward()
    count = sum(LENGTHS)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            v, old, g = float(vpreds[i, t].detach()), float(values[i, t]), float(returns[i, t])
            vc = min(max(v, old - clip), old + clip)
            want = (v - g) / count if (v - g) ** 2 >= (vc - g) ** 2 or vc == v else 0.0
            assert float(vpreds.grad[i, t]) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert bool((vpreds.grad[~mask.bool()] == 0).all())
    # A huge clip range is the plain squared error; mse ignores the range.
    wide = compute_value_loss("clipped", ValueLossInputs(vpreds, values, returns, mask), cliprange_value=1e9)
    mse = compute_value_loss("mse", ValueLossInputs(vpreds, values, returns, mask), cliprange_value=clip)
    assert (
        float(wide.loss.detach()) == pytest.approx(float(mse.loss.detach()), rel=1e-12)
        and mse.metrics["vf_clipfrac"] == 0
    )
    # token-mean over a global batch: micro-batches with num_tokens add up to the whole.
    halves = [
        compute_value_loss(
            "clipped", ValueLossInputs(vpreds[s], values[s], returns[s], mask[s], num_tokens=count), clip
        ).loss
        for s in (slice(0, 3), slice(3, 6))
    ]
    assert float(sum(halves).detach()) == pytest.approx(loss_want, rel=1e-12)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_value_loss("clipped", ValueLossInputs(vpreds, values, returns, mask), 0.5, "token-sum")
    with pytest.raises(ValueError, match="same shape"):
        compute_value_loss("clipped", ValueLossInputs(vpreds[:, :3], values, returns, mask))


def test_explained_variance_is_verls() -> None:
    _, values, mask, gen = _batch(seed=5)
    returns = _garbage(torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64), mask, 13)
    g = [float(returns[i, t]) for i, n in enumerate(LENGTHS) for t in range(n)]
    v = [float(values[i, t]) for i, n in enumerate(LENGTHS) for t in range(n)]

    def var(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    want = 1 - var([a - b for a, b in zip(g, v)]) / (var(g) + 1e-5)
    assert explained_variance(returns, values, mask) == pytest.approx(want, rel=1e-12)
    clean = returns.nan_to_num(0.0, 0.0, 0.0)
    assert explained_variance(clean, clean, mask) == pytest.approx(1.0)  # a perfect critic
