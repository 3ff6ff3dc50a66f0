"""Outcome advantage estimators: one scalar reward per response -> one advantage per response.

Responses come in groups: ``rewards`` is ``[num_prompts * group_size]`` with the ``group_size``
samples of a prompt next to each other (prompt 0's samples first), the layout the rollout
writes. Every estimator is registered in :data:`ADVANTAGES` and has the signature
``fn(rewards, group_size, eps) -> advantages`` (both 1-D, float32 at least);
:func:`compute_advantages` looks one up and broadcasts the result over the response tokens.

A group whose rewards are all equal carries no learning signal: every estimator gives it an
advantage of exactly 0 (never NaN, even though its standard deviation is 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mindspeed.registry import Registry

AdvantageFn = Callable[[torch.Tensor, int, float], torch.Tensor]

#: name -> outcome advantage estimator.
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def group_view(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` as ``[num_prompts, group_size]`` (in float32 at least).

    Raises:
        ValueError: if ``rewards`` is not 1-D, ``group_size < 2`` or does not divide its length.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(
            f"group size {group_size}: group-relative advantages need at least 2 samples per prompt "
            "(set rollout.n >= 2)"
        )
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    return rewards.to(dtype).view(-1, group_size)


def _constant_groups(groups: torch.Tensor) -> torch.Tensor:
    """``[num_prompts, 1]`` mask of groups whose rewards are all equal."""
    return groups.amax(-1, keepdim=True) == groups.amin(-1, keepdim=True)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r - mean_group) / (std_group + eps)``.

    ``std`` is the sample standard deviation (Bessel's correction), as in TRL and verl.
    """
    groups = group_view(rewards, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    adv = centred / (groups.std(-1, keepdim=True) + eps)
    return torch.where(_constant_groups(groups), torch.zeros_like(adv), adv).reshape(-1)


@ADVANTAGES.register("grpo_no_std")
def grpo_no_std_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``r - mean_group``, no division by the group's std.

    Dividing by the std up-weights prompts that are nearly always (or never) solved; leaving
    it out removes that question-difficulty bias. ``eps`` is unused (same signature).
    """
    groups = group_view(rewards, group_size)
    adv = groups - groups.mean(-1, keepdim=True)
    return torch.where(_constant_groups(groups), torch.zeros_like(adv), adv).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``, the leave-one-out baseline.

    Equal to ``G / (G - 1) * (r_i - mean_group)``. ``eps`` is unused (same signature).
    """
    groups = group_view(rewards, group_size)
    others = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
    adv = groups - others
    return torch.where(_constant_groups(groups), torch.zeros_like(adv), adv).reshape(-1)


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response advantages ``[batch]`` -> per-token ``[batch, len]``, zero on padding."""
    if advantages.dim() != 1 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} do not match the response mask "
            f"{tuple(response_mask.shape)} (one advantage per row)"
        )
    return advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)


def compute_advantages(
    name: str, rewards: torch.Tensor, group_size: int, response_mask: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages by the registered estimator ``name``.

    Args:
        name: a key of :data:`ADVANTAGES` (``grpo``, ``grpo_no_std``, ``rloo``).
        rewards: ``[num_prompts * group_size]``, grouped by prompt.
        group_size: samples per prompt (``rollout.n``).
        response_mask: ``[batch, len]``; when given the result is broadcast over its tokens.
        eps: added to the std of ``grpo`` so near-constant groups do not blow up.

    Returns:
        ``[batch]`` advantages, or ``[batch, len]`` (zero on padding) with ``response_mask``.

    Raises:
        ValueError: unknown estimator (listing the known ones) or badly shaped input.
    """
    advantages = ADVANTAGES.get(name)(rewards, group_size, eps)
    return advantages if response_mask is None else broadcast_to_tokens(advantages, response_mask)
