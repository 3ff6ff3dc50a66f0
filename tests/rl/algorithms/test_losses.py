"""Policy losses against TRL's / the DAPO paper's formulas written out token by token.

The references below loop over sequences and tokens with Python floats; they share no code
with the implementation. TRL (``GRPOTrainer._compute_loss``): per token
``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * (exp(ref - logp) - (ref - logp) - 1)``,
reduced per ``loss_type``: ``grpo`` = mean over sequences of the token mean, ``dapo``/``bnpo`` =
token mean over the batch, ``dr_grpo`` = sum / (batch * max_completion_length).
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms import (
    PolicyLossInputs,
    aggregate_loss,
    compute_policy_loss,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss_config,
)

B, T, V = 5, 7, 6
LENGTHS = [7, 3, 5, 1, 6]


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # ratios on both sides of the clip
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=torch.float64)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    return dict(logp=logp, old=old, ref=ref, rollout=rollout, adv=adv, mask=mask, logits=logits)


def _token_terms(b, eps_low, eps_high, beta, c=None, tis=None, seq_ratio=False):
    """Per-token loss values and clip flags, [[...] per sequence], plain Python."""
    rows, clipped = [], []
    for i in range(B):
        n = LENGTHS[i]
        lp, ol, rf, ro = (b[k][i].tolist() for k in ("logp", "old", "ref", "rollout"))
        a = b["adv"][i].item()
        seq_log_ratio = sum(lp[t] - ol[t] for t in range(n)) / n
        row, flags = [], []
        for t in range(n):
            r = math.exp(seq_log_ratio if seq_ratio else lp[t] - ol[t])
            unclipped, clip = -r * a, -min(max(r, 1 - eps_low), 1 + eps_high) * a
            value = max(unclipped, clip)
            flags.append(clip > unclipped)
            if c is not None and a < 0:
                value = min(value, -a * c)
            if tis is not None:
                value *= min(math.exp(ol[t] - ro[t]), tis)
            kl = math.exp(rf[t] - lp[t]) - (rf[t] - lp[t]) - 1
            row.append(value + beta * kl)
        rows.append(row)
        clipped.append(flags)
    return rows, clipped


def _inputs(b, **extra) -> PolicyLossInputs:
    return PolicyLossInputs(
        logp=b["logp"], old_logp=b["old"], advantages=b["adv"], mask=b["mask"], ref_logp=b["ref"], **extra
    )


def test_grpo_loss_equals_trl_grpo_formula() -> None:
    b = _batch()
    rows, _ = _token_terms(b, 0.2, 0.2, beta=0.04)
    expected = sum(sum(r) / len(r) for r in rows) / B  # TRL loss_type="grpo"
    config = policy_loss_config("ppo_clip", loss_agg_mode="seq-mean-token-mean", kl_coef=0.04, kl_estimator="k3")
    out = compute_policy_loss("ppo_clip", _inputs(b), config)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


def test_dapo_loss_equals_paper_formula() -> None:
    # DAPO eq. (8): token-level sum over all responses of the group / total tokens, clip 0.2 / 0.28, no KL.
    b = _batch(1)
    rows, clipped = _token_terms(b, 0.2, 0.28, beta=0.0)
    tokens = sum(LENGTHS)
    out = compute_policy_loss("dapo", _inputs(b))
    assert out.loss.item() == pytest.approx(sum(map(sum, rows)) / tokens, rel=1e-12)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(sum(map(sum, clipped)) / tokens)
    assert 0 < out.metrics["pg_clipfrac"].item() < 1  # the batch does exercise the clip


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"])
def test_other_aggregations(mode: str) -> None:
    b = _batch(2)
    rows, _ = _token_terms(b, 0.2, 0.2, beta=0.001)
    expected = {
        "seq-mean-token-sum": sum(map(sum, rows)) / B,
        "seq-mean-token-sum-norm": sum(map(sum, rows)) / (B * T),  # TRL dr_grpo
        "token-mean": sum(map(sum, rows)) / sum(LENGTHS),
    }[mode]
    out = compute_policy_loss("ppo_clip", _inputs(b), policy_loss_config("ppo_clip", loss_agg_mode=mode))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


def test_dual_clip_tis_and_sequence_ratio() -> None:
    b = _batch(3)
    for kwargs, ref_kwargs in [
        (dict(clip_ratio_c=1.5), dict(c=1.5)),
        (dict(tis_cap=1.2), dict(tis=1.2)),
        (dict(ratio_level="sequence"), dict(seq_ratio=True)),
    ]:
        rows, _ = _token_terms(b, 0.2, 0.2, beta=0.0, **ref_kwargs)
        config = policy_loss_config("ppo_clip", kl_coef=0.0, **kwargs)
        out = compute_policy_loss("ppo_clip", _inputs(b, rollout_logp=b["rollout"]), config)
        assert out.loss.item() == pytest.approx(sum(map(sum, rows)) / sum(LENGTHS), rel=1e-12), kwargs
    tis = compute_policy_loss(
        "ppo_clip", _inputs(b, rollout_logp=b["rollout"]), policy_loss_config("ppo_clip", tis_cap=1.2)
    ).metrics
    weights = [min(math.exp(b["old"][i, t] - b["rollout"][i, t]), 1.2) for i in range(B) for t in range(LENGTHS[i])]
    assert tis["tis_weight_mean"].item() == pytest.approx(sum(weights) / len(weights))
    assert 0 < tis["tis_clipfrac"].item() < 1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator: str) -> None:
    b = _batch(4)
    kl = []
    for i in range(B):
        for t in range(LENGTHS[i]):
            x = b["logp"][i, t].item() - b["ref"][i, t].item()
            kl.append({"k1": x, "k2": x * x / 2, "k3": math.exp(-x) + x - 1}[estimator])
    out = compute_policy_loss("ppo_clip", _inputs(b), policy_loss_config("ppo_clip", kl_estimator=estimator))
    assert out.metrics["kl_loss"].item() == pytest.approx(sum(kl) / len(kl), rel=1e-12)


def test_metrics_ratio_kl_entropy() -> None:
    b = _batch(5)
    out = compute_policy_loss("ppo_clip", _inputs(b, logits=b["logits"]))
    ratios, ppo_kl, approx_kl, entropies = [], [], [], []
    for i in range(B):
        for t in range(LENGTHS[i]):
            d = b["logp"][i, t].item() - b["old"][i, t].item()
            ratios.append(math.exp(d))
            ppo_kl.append(-d)
            approx_kl.append(math.exp(d) - 1 - d)  # Schulman's k3 of old vs new
            z = b["logits"][i, t].tolist()
            total = sum(math.exp(v) for v in z)
            entropies.append(-sum(math.exp(v) / total * math.log(math.exp(v) / total) for v in z))
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios))
    assert m["ratio_max"] == pytest.approx(max(ratios)) and m["ratio_min"] == pytest.approx(min(ratios))
    assert m["ppo_kl"] == pytest.approx(sum(ppo_kl) / len(ppo_kl))
    assert m["approx_kl"] == pytest.approx(sum(approx_kl) / len(approx_kl))
    assert m["entropy"] == pytest.approx(sum(entropies) / len(entropies))


def test_gradients_match_finite_differences() -> None:
    b = _batch(6)
    mask, adv, old, ref = b["mask"][:3, :4], b["adv"][:3], b["old"][:3, :4], b["ref"][:3, :4]
    logits = b["logits"][:3, :4].clone().requires_grad_(True)
    labels = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1], [2, 2, 3, 3]])
    for name, settings in [
        ("ppo_clip", dict(kl_coef=0.1, loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01)),
        ("dapo", dict(clip_ratio_c=2.0)),
    ]:
        config = policy_loss_config(name, **settings)

        def loss_of(z: torch.Tensor) -> torch.Tensor:
            inputs = PolicyLossInputs(
                logp=logprobs_from_logits(z, labels), old_logp=old, advantages=adv, mask=mask, ref_logp=ref, logits=z
            )
            return compute_policy_loss(name, inputs, config).loss

        # fast_mode: finite differences along random directions (the full Jacobian takes ~15 s on 2 cores).
        assert torch.autograd.gradcheck(loss_of, (logits,), eps=1e-6, atol=1e-7, fast_mode=True)


def test_gradient_closed_form_single_tokens() -> None:
    # Two tokens, A = 1, token-mean: d loss / d logp = -ratio / 2 where unclipped, 0 where clipped
    # (ratio > 1.2), plus the k3 term beta * (1 - exp(ref - logp)) / 2.
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.2, 0.3]], dtype=torch.float64)
    beta = 0.5
    out = compute_policy_loss(
        "ppo_clip",
        PolicyLossInputs(logp, old, torch.ones(1), torch.ones(1, 2), ref_logp=ref),
        policy_loss_config("ppo_clip", kl_coef=beta),
    )
    out.loss.backward()
    expected = [(-math.exp(0.1) + beta * (1 - math.exp(-0.3))) / 2, (beta * (1 - math.exp(-0.2))) / 2]
    torch.testing.assert_close(logp.grad, torch.tensor([expected], dtype=torch.float64))


def test_padding_garbage_does_not_leak() -> None:
    b = _batch(7)
    pad = b["mask"] == 0
    dirty = {k: (v.masked_fill(pad, float("nan")) if k in ("logp", "old", "ref") else v) for k, v in b.items()}
    dirty["logp"] = dirty["logp"].clone().requires_grad_(True)
    clean = compute_policy_loss("ppo_clip", _inputs(b))
    out = compute_policy_loss("ppo_clip", _inputs(dirty))
    assert out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-12)
    out.loss.backward()
    assert torch.isfinite(dirty["logp"].grad).all() and (dirty["logp"].grad[pad] == 0).all()


def test_micro_batches_add_up_to_the_global_loss() -> None:
    b = _batch(8)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        config = policy_loss_config("ppo_clip", loss_agg_mode=mode)
        full = compute_policy_loss("ppo_clip", _inputs(b), config).loss
        total = 0.0
        for rows in (slice(0, 2), slice(2, 5)):
            part = {k: v[rows] for k, v in b.items()}
            inputs = _inputs(part, num_tokens=float(sum(LENGTHS)), num_seqs=float(B))
            total += compute_policy_loss("ppo_clip", inputs, config).loss.item()
        assert total == pytest.approx(full.item(), rel=1e-12), mode


def test_helpers_and_errors() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    labels = torch.tensor([[0, 4, 2], [1, 1, 3]])
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels), torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    )
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    b = _batch()
    with pytest.raises(ValueError, match="pass ref_logp"):
        compute_policy_loss("ppo_clip", PolicyLossInputs(b["logp"], b["old"], b["adv"], b["mask"]))
    with pytest.raises(ValueError, match="pass rollout_logp"):
        compute_policy_loss("dapo", _inputs(b), policy_loss_config("dapo", tis_cap=2.0))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss_config("ppo_clip", clip_ratio_c=0.5).validate()
    with pytest.raises(ValueError, match="unknown policy loss setting"):
        policy_loss_config("ppo_clip", clip=0.1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(torch.ones(2, 2), torch.ones(2, 2), "mean")
    assert policy_loss_config("dapo").clip_eps_high == 0.28 and policy_loss_config("dapo").kl_coef == 0.0
