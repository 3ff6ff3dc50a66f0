"""Policy-gradient losses: PPO-clip (GRPO's surrogate) and DAPO's settings of it.

A loss is registered in :data:`POLICY_LOSSES` as a :class:`PolicyLossSpec`: the function and
its default :class:`PolicyLossConfig`. ``ppo_clip`` defaults follow verl's GRPO recipe (symmetric
clip 0.2, token-mean, k3 KL to the reference with coefficient 0.001); ``dapo`` is the same
surrogate with DAPO's settings (clip-higher 0.2 / 0.28, token-level aggregation over the whole
batch, no KL). DAPO's other two parts act on rewards and batches, not on the loss: see
:mod:`mindspeed_rl.algorithms.shaping`.

Per token, with ``ratio = exp(logp - old_logp)`` and advantage ``A``::

    pg  = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    pg  = min(pg, -A * c)                   where A < 0, with dual clip c (optional)
    pg *= min(exp(old_logp - rollout_logp), C)         truncated importance sampling (optional)
    loss = agg(pg) + kl_coef * agg(kl(logp, ref_logp)) - entropy_coef * agg(entropy)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mindspeed.registry import Registry
from mindspeed_rl.algorithms.functional import LOSS_AGG_MODES, aggregate_loss, entropy_from_logits, masked_mean
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty

#: log-ratios are clamped to this range before ``exp`` (as verl does) so one wild token cannot overflow.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of a policy loss.

    Attributes:
        clip_eps_low: the ratio is clipped below at ``1 - clip_eps_low``.
        clip_eps_high: ... and above at ``1 + clip_eps_high`` (DAPO's clip-higher: > low).
        clip_ratio_c: dual clip: for negative advantages the loss is capped at ``-A * c``
            (``c > 1``; default none).
        loss_agg_mode: one of :data:`~mindspeed_rl.algorithms.functional.LOSS_AGG_MODES`.
        kl_coef: weight (beta) of the KL penalty to the reference policy (0: none).
        kl_estimator: a key of :data:`~mindspeed_rl.algorithms.kl.KL_ESTIMATORS`.
        entropy_coef: weight of an entropy bonus (0: none; entropy is still reported).
        ratio_level: ``token`` (PPO/GRPO) or ``sequence`` (GSPO: the length-normalised
            sequence log-ratio, shared by every token of the sequence).
        tis_cap: truncated importance sampling: weight each token by
            ``min(exp(old_logp - rollout_logp), tis_cap)`` to correct for samples drawn by an
            older (asynchronous) or numerically different rollout policy (default none).
        norm_length: the constant divisor of ``seq-mean-token-sum-norm`` (Dr. GRPO's maximum
            response length; default the padded width of the batch).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float | None = None
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.001
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    ratio_level: Literal["token", "sequence"] = "token"
    tis_cap: float | None = None
    norm_length: int | None = None

    def validate(self) -> None:
        """Raises ValueError naming the setting that is out of range."""
        if not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low} must be in (0, 1)")
        if self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be positive")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} (dual clip) must be above 1, e.g. 3")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} and entropy_coef={self.entropy_coef} must be >= 0")
        KL_ESTIMATORS.get(self.kl_estimator)
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"ratio_level={self.ratio_level!r}; use token or sequence")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap={self.tis_cap} must be at least 1 (e.g. 2)")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length={self.norm_length} must be a positive number of tokens")


@dataclass
class PolicyLossInputs:
    """One (micro-)batch for a policy loss; per-token tensors are ``[batch, len]``.

    Attributes:
        logp: log-probs of the response tokens under the policy being trained (with grad).
        old_logp: the same under the policy the update started from (the "old" policy).
        advantages: ``[batch, len]`` or ``[batch]`` (broadcast over the tokens).
        mask: 1 on response tokens that count.
        ref_logp: log-probs under the frozen reference (needed when ``kl_coef > 0``).
        rollout_logp: log-probs the rollout engine reported (needed with ``tis_cap``).
        logits: ``[batch, len, vocab]`` for the entropy (metric, and bonus with ``entropy_coef``).
        entropy: per-token entropy, when computed elsewhere (e.g. per vocabulary shard).
        num_tokens: token count of the whole global batch (token-mean over micro-batches).
        num_seqs: sequence count of the whole global batch (the sequence modes).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None


@dataclass
class PolicyLossOutput:
    """The loss (differentiable scalar) and detached scalar metrics (``pg_clipfrac``, ...)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A registered policy loss: ``fn(inputs, config)`` and its default settings."""

    fn: Callable[[PolicyLossInputs, PolicyLossConfig], PolicyLossOutput]
    defaults: PolicyLossConfig


#: name -> policy loss.
POLICY_LOSSES: Registry[PolicyLossSpec] = Registry("policy loss")


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    if not bool(mask.any()):
        return values.new_zeros(())
    fill = float("-inf") if largest else float("inf")
    filled = values.masked_fill(~mask.bool(), fill)
    return filled.max() if largest else filled.min()


def ppo_clip_loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> PolicyLossOutput:
    """The clipped surrogate with optional dual clip, KL penalty, entropy bonus and TIS.

    Args:
        inputs: the batch (see :class:`PolicyLossInputs`).
        config: the settings (validated here).

    Returns:
        The loss and the metrics ``pg_loss``, ``pg_clipfrac``, ``ppo_kl`` (mean of
        ``old_logp - logp``), ``approx_kl`` (k3 of the old and the new policy), ``ratio_mean``,
        ``ratio_max``, ``ratio_min``; ``kl_loss`` with ``ref_logp``; ``entropy`` with
        ``logits``/``entropy``; ``pg_clipfrac_lower`` with dual clip; ``tis_weight_mean`` and
        ``tis_clipfrac`` with TIS.

    Raises:
        ValueError: on bad settings, mismatched shapes, or a missing input a setting needs.
    """
    config.validate()
    logp, mask = inputs.logp, inputs.mask.to(inputs.logp.dtype)
    if inputs.old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(inputs.old_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [batch, len] shape"
        )
    keep = mask.bool()

    def clean(values: torch.Tensor) -> torch.Tensor:
        # Padding is zeroed before any exp: where() alone would still send NaN gradients back
        # through exp(garbage) (0 * inf), so a -inf log-prob on a pad token would poison the step.
        return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))

    logp = clean(logp)
    old_logp = clean(inputs.old_logp.detach())
    advantages = inputs.advantages.detach().to(logp.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    advantages = clean(advantages)
    agg: dict[str, Any] = dict(
        mode=config.loss_agg_mode,
        num_tokens=inputs.num_tokens,
        num_seqs=inputs.num_seqs,
        norm_length=config.norm_length,
    )

    log_ratio = logp - old_logp
    if config.ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(logp.dtype), mask)}
    if config.clip_ratio_c is not None:
        cap = -advantages * config.clip_ratio_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = masked_mean(((pg > cap) & negative).to(logp.dtype), mask)
        pg = torch.where(negative, torch.minimum(pg, cap), pg)
    if config.tis_cap is not None:
        if inputs.rollout_logp is None:
            raise ValueError("tis_cap is set: pass rollout_logp (the rollout engine's log-probs of the samples)")
        raw = torch.exp((old_logp - clean(inputs.rollout_logp.detach())).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = raw.clamp(max=config.tis_cap)
        pg = pg * weight
        metrics["tis_weight_mean"] = masked_mean(weight, mask)
        metrics["tis_clipfrac"] = masked_mean((raw > config.tis_cap).to(logp.dtype), mask)
    pg_loss = aggregate_loss(pg, mask, **agg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss

    if inputs.ref_logp is not None:
        kl_loss = aggregate_loss(kl_penalty(logp, clean(inputs.ref_logp.detach()), config.kl_estimator), mask, **agg)
        metrics["kl_loss"] = kl_loss
        if config.kl_coef:
            loss = loss + config.kl_coef * kl_loss
    elif config.kl_coef:
        raise ValueError(f"kl_coef={config.kl_coef}: pass ref_logp (the reference's log-probs), or set kl_coef=0")

    entropy = (
        inputs.entropy
        if inputs.entropy is not None
        else (entropy_from_logits(inputs.logits) if inputs.logits is not None else None)
    )
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * aggregate_loss(entropy, mask, **agg)
    elif config.entropy_coef:
        raise ValueError(f"entropy_coef={config.entropy_coef}: pass logits or entropy, or set entropy_coef=0")

    with torch.no_grad():
        true_log_ratio = logp - old_logp
        metrics["ppo_kl"] = masked_mean(-true_log_ratio, mask)
        metrics["approx_kl"] = masked_mean(torch.expm1(true_log_ratio) - true_log_ratio, mask)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["ratio_max"] = _masked_extreme(ratio, mask, largest=True)
        metrics["ratio_min"] = _masked_extreme(ratio, mask, largest=False)
    metrics["loss"] = loss
    return PolicyLossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


POLICY_LOSSES.register("ppo_clip", PolicyLossSpec(ppo_clip_loss, PolicyLossConfig()))
POLICY_LOSSES.register(
    "dapo",
    PolicyLossSpec(
        ppo_clip_loss, PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg_mode="token-mean", kl_coef=0.0)
    ),
)


def policy_loss_config(name: str, **overrides: Any) -> PolicyLossConfig:
    """The defaults of loss ``name`` with the ``overrides`` that are not None applied.

    Raises:
        ValueError: unknown loss or unknown setting name.
    """
    defaults = POLICY_LOSSES.get(name).defaults
    known = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown policy loss setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return dataclasses.replace(defaults, **{k: v for k, v in overrides.items() if v is not None})


def compute_policy_loss(
    name: str, inputs: PolicyLossInputs, config: PolicyLossConfig | None = None
) -> PolicyLossOutput:
    """Run the registered loss ``name`` (with its defaults when ``config`` is None)."""
    spec = POLICY_LOSSES.get(name)
    return spec.fn(inputs, config or spec.defaults)
