"""REINFORCE++ (Hu 2025, arXiv 2501.03262) and REINFORCE++-baseline: token-level advantages.

Unlike the outcome estimators of :mod:`mindspeed_rl.algorithms.advantages` (one number per
response), these give one advantage per response token. Per response ``i`` with ``L_i`` tokens,
outcome reward ``R_i`` and (with ``algorithm.use_kl_in_reward``) the per-token KL estimate
``kl_{i,t}`` of the policy to the reference, weighted by ``beta``::

    r_{i,t} = -beta * kl_{i,t} + (R_i if t == L_i - 1 else 0)         KL folded into the reward
    G_{i,t} = sum_{s >= t} gamma^(s - t) * r_{i,s}                      discounted return
    A       = (G - mean(G)) / sqrt(var(G) + 1e-8)                       over every token of the batch

``mean`` and ``var`` run over the response tokens of the whole batch (``var`` with Bessel's
correction), as verl's ``masked_whiten``; padding gets 0. REINFORCE++-baseline first subtracts
each prompt group's mean outcome reward, ``R_i - mean_group(R)``, then does the same (OpenRLHF's
``reinforce_baseline``; verl's ``reinforce_plus_plus_baseline`` equals it without a KL-in-reward
term, see docs/rl/algorithms.md).

Registered in :data:`TOKEN_ADVANTAGES` with ``fn(rewards, mask, group_size, token_rewards, gamma)
-> [batch, len]``; ``token_rewards`` is the per-token part of ``r`` (``-beta * kl``, or None).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mindspeed.registry import Registry
from mindspeed_rl.algorithms.advantages import group_view
from mindspeed_rl.algorithms.functional import masked_mean, masked_sum

TokenAdvantageFn = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None", float], torch.Tensor]

#: name -> token-level advantage estimator (verl's names).
TOKEN_ADVANTAGES: Registry[TokenAdvantageFn] = Registry("token-level advantage estimator")

#: added to the variance before the square root (verl's ``masked_whiten``).
WHITEN_EPS = 1e-8


def token_rewards_with_outcome(
    rewards: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """``[batch, len]`` per-token rewards: ``token_rewards`` (0 on padding) plus each outcome at its last token.

    Raises:
        ValueError: mismatched shapes, or a response without tokens.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)}: need [batch] and [batch, len]")
    lengths = mask.sum(-1).long()
    if bool((lengths == 0).any()):
        raise ValueError("a response has no tokens: every row of the response mask needs at least one 1")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if token_rewards is not None:
        if token_rewards.shape != mask.shape:
            raise ValueError(f"token_rewards {tuple(token_rewards.shape)} must match the mask {tuple(mask.shape)}")
        out = torch.where(mask.bool(), token_rewards.to(dtype), out)
    # The last token that counts: the highest column where the mask is set.
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), columns, torch.full_like(columns, -1)).amax(-1)
    out[torch.arange(mask.shape[0], device=mask.device), last] += rewards.to(dtype)
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` within each response (nothing flows in from padding); 0 on padding."""
    keep = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = (token_rewards[:, t] + gamma * running) * keep[:, t]
        returns[:, t] = running
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (``var`` unbiased), 0 where unmasked.

    All-equal values (and a single token) give exactly 0.
    """
    keep = mask.bool()
    if bool(keep.any()) and bool(values[keep].amax() == values[keep].amin()):
        # All equal (e.g. every reward the same, no KL): no signal, exactly 0, not rounding noise * 1e4.
        return torch.zeros_like(values)
    mean = masked_mean(values, mask)
    count = mask.sum()
    centred = values - mean
    var = masked_sum(centred.square(), mask) / (count - 1).clamp(min=1)
    whitened = centred * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def _constant(groups: torch.Tensor) -> torch.Tensor:
    return groups.amax(-1, keepdim=True) == groups.amin(-1, keepdim=True)


@TOKEN_ADVANTAGES.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: whitened discounted returns of the KL-shaped per-token rewards (no group baseline).

    ``group_size`` is unused (same signature as the baseline variant).
    """
    del group_size
    return masked_whiten(
        discounted_returns(token_rewards_with_outcome(rewards, mask, token_rewards), mask, gamma), mask
    )


@TOKEN_ADVANTAGES.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++-baseline: the outcome reward minus its prompt group's mean, then as REINFORCE++."""
    groups = group_view(rewards, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    # An all-equal group is exactly 0 (its mean may not round-trip: mean([0.7] * 4) != 0.7).
    centred = torch.where(_constant(groups), torch.zeros_like(centred), centred).reshape(-1)
    return reinforce_plus_plus_advantages(centred, mask, group_size, token_rewards, gamma)


def compute_token_advantages(
    name: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """``[batch, len]`` advantages by the registered token-level estimator ``name`` (0 on padding).

    Raises:
        ValueError: unknown estimator (listing the known ones) or badly shaped input.
    """
    return TOKEN_ADVANTAGES.get(name)(rewards, mask, group_size, token_rewards, gamma)
