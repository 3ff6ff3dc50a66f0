"""Flow-GRPO / DanceGRPO: flow-matching sampling as an SDE, its per-step log-probabilities and the policy loss.

Flow matching writes ``x_t = (1 - t) x0 + t noise`` and the model predicts ``v = noise - x0``; the ODE
sampler (diffusers' Euler) steps ``x_{t+dt} = x_t + v dt`` with ``dt = t_next - t < 0``. Flow-GRPO (Liu et
al. 2025) turns each step into a Gaussian with the same marginals, so that a sample has a likelihood::

    mean = x_t + [v + sigma_t^2 / (2 t) (x_t + (1 - t) v)] dt
    std  = sigma_t sqrt(-dt),    sigma_t = a sqrt(t / (1 - t))      (a: the noise level)
    x_{t+dt} = mean + std eps,   log p = mean over the elements of log N(x_{t+dt}; mean, std^2)

At ``t = 1`` the noise scale uses ``sqrt(t / (1 - t_1))`` with ``t_1`` the second sigma of the schedule,
as Flow-GRPO's ``sde_step_with_logprob`` does (the formula is infinite there). The log-probability is the
mean over a sample's elements (Flow-GRPO's reduction), so a ratio ``exp(logp - old_logp)`` stays near 1
at any latent size. With ``a = 0`` the mean is the Euler step.

The loss is GRPO's over the denoising steps: every recorded step of a sample is one "token" of the
registered clipped objective (:mod:`mindspeed_rl.algorithms.losses`, ``ppo_clip``) with the sample's
group-relative advantage (:mod:`mindspeed_rl.algorithms.advantages`), on a subset of the steps
(:func:`select_steps`: DanceGRPO's random ``timestep_fraction`` of them, or Flow-GRPO's first ones), plus
optionally Flow-GRPO's KL to the reference: for two Gaussians of one std it is
``|mean - ref_mean|^2 / (2 std^2)``, here averaged over the elements like the log-probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mindspeed_rl.algorithms.losses import PolicyLossConfig, PolicyLossInputs, PolicyLossOutput, ppo_clip_loss

#: how :func:`select_steps` picks the trained steps: DanceGRPO draws them, Flow-GRPO takes the first ones.
STEP_SELECTIONS = ("random", "first")


def per_prompt_advantages(
    rewards: torch.Tensor, prompts: list[str], global_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Flow-GRPO's per-prompt stat tracking (its ``PerPromptStatTracker``, cleared every round): each reward
    minus the mean of the round's rewards of its prompt, over the std (population, ``+ eps``) of the round's
    rewards, all of them with ``global_std`` (Flow-GRPO's default ``sample.global_std = True``) or its
    prompt's. A prompt whose rewards are all equal gets 0 with ``global_std`` (and when the round's rewards are
    all equal).

    Raises:
        ValueError: a prompt count other than the rewards'.
    """
    if rewards.dim() != 1 or rewards.numel() != len(prompts):
        raise ValueError(f"{tuple(rewards.shape)} rewards for {len(prompts)} prompts: give one prompt a reward")
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    for prompt in dict.fromkeys(prompts):
        mask = torch.tensor([p == prompt for p in prompts])
        group = rewards[mask]
        std = (rewards if global_std else group).std(correction=0) + eps
        advantages[mask] = (group - group.mean()) / std
    return advantages.float()


def sde_noise_scale(
    sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: float, noise_level: float
) -> torch.Tensor:
    """The std of one SDE step from ``sigma`` to ``sigma_next``: ``a sqrt(t / (1 - t)) sqrt(t - t_next)``.

    ``sigma_max`` (the schedule's second sigma) replaces ``t`` in ``1 - t`` where ``t = 1``.
    """
    sigma = sigma.double()
    denominator = 1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_max), sigma)
    return (noise_level * torch.sqrt(sigma / denominator) * torch.sqrt(sigma - sigma_next.double())).float()


def sde_step_mean(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_scale: torch.Tensor,
) -> torch.Tensor:
    """``x_t + [v + s^2 / (2 t) (x_t + (1 - t) v)] dt`` where ``s^2 dt = -noise_scale^2`` (float32).

    ``sigma``, ``sigma_next`` and ``noise_scale`` are scalars or ``[B]``; with ``noise_scale = 0`` this is
    exactly diffusers' Euler step ``x_t + v dt``.
    """
    view = (-1,) + (1,) * (latents.ndim - 1)
    sigma, sigma_next = sigma.float().reshape(view), sigma_next.float().reshape(view)
    noise_scale = noise_scale.float().reshape(view)
    dt = sigma_next - sigma
    latents, velocity = latents.float(), velocity.float()
    # s^2 dt / (2 t) with s^2 = noise_scale^2 / (-dt): the drift correction of the SDE
    correction = -(noise_scale**2) / (2 * sigma)
    return latents * (1 + correction) + velocity * (dt + correction * (1 - sigma))


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, noise_scale: torch.Tensor) -> torch.Tensor:
    """``[B]``: the mean over each sample's elements of ``log N(sample; mean, noise_scale^2)``."""
    view = (-1,) + (1,) * (sample.ndim - 1)
    scale = noise_scale.float().reshape(view)
    log_prob = (
        -((sample.float().detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    )
    return log_prob.reshape(log_prob.shape[0], -1).mean(dim=1)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, noise_scale: torch.Tensor) -> torch.Tensor:
    """``[B]``: KL of two Gaussians of one std, ``(mean - ref_mean)^2 / (2 std^2)``, averaged over the elements."""
    view = (-1,) + (1,) * (mean.ndim - 1)
    kl = (mean - ref_mean.detach()) ** 2 / (2 * noise_scale.float().reshape(view) ** 2)
    return kl.reshape(kl.shape[0], -1).mean(dim=1)


def select_steps(num_steps: int, fraction: float, generator: torch.Generator, how: str = "random") -> torch.Tensor:
    """The denoising steps trained on: ``max(1, round(fraction x num_steps))`` of them, ascending (int64).

    ``random``: drawn without replacement with ``generator`` (DanceGRPO); ``first``: the first ones (Flow-GRPO).

    Raises:
        ValueError: a fraction outside (0, 1] or an unknown ``how``.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"timestep_fraction={fraction} must be in (0, 1] (the share of denoising steps trained on)")
    if how not in STEP_SELECTIONS:
        raise ValueError(f"step selection {how!r} is unknown; use one of {', '.join(STEP_SELECTIONS)}")
    count = max(1, round(fraction * num_steps))
    if how == "first":
        return torch.arange(count)
    return torch.randperm(num_steps, generator=generator)[:count].sort().values


@dataclass
class FlowGRPOLossOutput:
    """The loss, the policy loss's metrics (``pg_clipfrac``, ``ratio_mean``, ...) and ``kl`` with a reference."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def flow_grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> FlowGRPOLossOutput:
    """The clipped objective over the trained steps, plus ``kl_coef`` times the mean KL to the reference.

    Args:
        log_probs: ``[B, K]`` the current policy's log-probabilities of the recorded steps (with grad).
        old_log_probs: ``[B, K]`` the ones recorded when sampling.
        advantages: ``[B]`` one per sample (group-relative, already clipped if wanted).
        config: the ``ppo_clip`` settings; its own ``kl_coef`` must be 0 (the KL here is on the means).
        kl: ``[B, K]`` :func:`gaussian_kl` per step, when a reference is used.
        kl_coef: its weight.

    Raises:
        ValueError: mismatched shapes, a ``ppo_clip`` KL, or ``kl_coef`` without ``kl``.
    """
    if log_probs.shape != old_log_probs.shape or log_probs.ndim != 2 or advantages.shape != log_probs.shape[:1]:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)} and old_log_probs {tuple(old_log_probs.shape)} must be [B, K] and "
            f"advantages {tuple(advantages.shape)} [B]"
        )
    if config.kl_coef:
        raise ValueError("policy loss kl_coef must be 0 for Flow-GRPO: give kl_coef here (the KL of the step means)")
    mask = torch.ones_like(log_probs)
    out: PolicyLossOutput = ppo_clip_loss(PolicyLossInputs(log_probs, old_log_probs, advantages, mask), config)
    loss, metrics = out.loss, dict(out.metrics)
    if kl is not None:
        kl_mean = kl.mean()
        metrics["kl"] = kl_mean.detach()
        loss = loss + kl_coef * kl_mean
    elif kl_coef:
        raise ValueError(f"kl_coef={kl_coef}: pass the KL to the reference (gaussian_kl), or set kl_coef=0")
    metrics["loss"] = loss.detach()
    return FlowGRPOLossOutput(loss, metrics)
