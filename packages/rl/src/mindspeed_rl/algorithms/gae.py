"""Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438): PPO's advantages from a critic.

Per response of ``L`` tokens with per-token rewards ``r_t`` (the outcome reward at the last
token, minus ``beta * kl_t`` on every token when the KL is folded into the reward) and the
critic's values ``V_t``::

    delta_t = r_t + gamma * V_{t+1} - V_t          (V_L = 0: nothing after the end of the response)
    A_t     = delta_t + gamma * lam * A_{t+1}      (A_L = 0)
    G_t     = A_t + V_t                            the critic's regression target (returns)

and the advantages the policy loss sees are ``A`` whitened over every response token of the
batch (:func:`~mindspeed_rl.algorithms.reinforce.masked_whiten`: mean, unbiased variance,
``+1e-8``), as verl's ``compute_gae_advantage_return`` (``verl/trainer/ppo/core_algos.py``):
the returns use the advantages before whitening.

Tensors are ``[batch, len]``, right-padded; the mask holds 1 on the tokens that count (the
response up to and including its EOS). A position the mask skips inside a response (a tool's
observation in a multi-turn rollout) is passed over as verl passes it: its reward and value do
not enter, and the recursion carries ``V`` and ``A`` across it. Padding may hold anything
(inf, NaN): it is selected away, never multiplied by 0, and the advantages and returns are 0 there.

Registered in :data:`VALUE_ADVANTAGES` with ``fn(token_rewards, values, mask, gamma, lam) ->
(advantages before whitening, returns)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mindspeed.registry import Registry
from mindspeed_rl.algorithms.reinforce import masked_whiten

ValueAdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]

#: name -> advantage estimator that needs a critic's values (verl's names).
VALUE_ADVANTAGES: Registry[ValueAdvantageFn] = Registry("critic-based advantage estimator")


def _check_shapes(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.dim() != 2 or token_rewards.shape != mask.shape or values.shape != mask.shape:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must all be [batch, len]"
        )


@VALUE_ADVANTAGES.register("gae")
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages (not whitened) and returns ``A + V``, both 0 on padding.

    Raises:
        ValueError: mismatched shapes.
    """
    _check_shapes(token_rewards, values, mask)
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    keep = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    rewards = torch.where(keep, token_rewards.to(dtype), zero)
    vals = torch.where(keep, values.to(dtype), zero)
    advantages = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    next_value = torch.zeros(mask.shape[0], dtype=dtype, device=mask.device)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        gae = delta + gamma * lam * last_gae
        # A skipped position carries the value and the advantage of the next counted token across.
        next_value = torch.where(keep[:, t], vals[:, t], next_value)
        last_gae = torch.where(keep[:, t], gae, last_gae)
        advantages[:, t] = torch.where(keep[:, t], last_gae, zero)
    returns = torch.where(keep, advantages + vals, zero)
    return advantages, returns


def compute_value_advantages(
    name: str,
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` by the registered critic-based estimator ``name``.

    The advantages are whitened over the batch's response tokens when ``whiten`` (verl's GAE
    always does); the returns never are.

    Raises:
        ValueError: unknown estimator (listing the known ones) or badly shaped input.
    """
    advantages, returns = VALUE_ADVANTAGES.get(name)(token_rewards, values, mask, gamma, lam)
    return (masked_whiten(advantages, mask) if whiten else advantages), returns
