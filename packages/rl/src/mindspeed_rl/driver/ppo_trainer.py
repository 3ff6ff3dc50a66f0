"""PPO with a critic, one step on a rollout batch: the GRPO step's pieces plus values, GAE and the critic update.

One step (:func:`ppo_train_on_batch`, called by :class:`~mindspeed_rl.driver.ppo_runner.PPORunner` after
the rollout and the rewards, as GRPO's ``train_on_batch``)::

    old log-probs (the actor's, when the KL is in the reward or the update is off-policy)
    -> reference log-probs -> values (the critic, at every response token)
    -> token rewards: the outcome reward at the last token, minus beta * kl_t on every token
       (algorithm.use_kl_in_reward; beta from the KL controller algorithm.kl_ctrl, updated after)
    -> GAE (algorithm.gamma, algorithm.lam): advantages whitened over the batch's tokens, returns
    -> actor update(s) with the policy-loss registry (skipped during critic.warmup_steps)
    -> critic update(s): critic.ppo_epochs x the actor's mini-batches, the value loss against the returns

A multi-turn batch's loss mask (0 on the tool responses) is the response mask of every piece:
the KL penalty and the outcome reward sit on generated tokens, GAE passes over the tool tokens
(the GAE of the generated tokens alone), the advantages are whitened over the generated tokens and
0 on the tool tokens, and the critic's value loss skips them (tests/rl/driver/test_ppo_tool_mask.py,
tests/rl/driver/test_tool_rollout.py).

The step's record adds verl's critic metrics (``critic/vf_loss``, ``critic/vpred_mean``,
``critic/vf_clipfrac``, ``critic/vf_explained_var``, ``critic/returns_mean``,
``critic/values_mean``, ``critic/advantages_mean``, ``critic/grad_norm``, ``critic/lr``; a MoE
critic's ``critic/load_balancing_loss`` / ``critic/z_loss``) and the KL controller's
``kl_in_reward`` / ``kl_coef``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_rl.algorithms import kl_penalty, masked_mean
from mindspeed_rl.algorithms.gae import compute_value_advantages
from mindspeed_rl.algorithms.kl_control import KLController, apply_kl_penalty
from mindspeed_rl.algorithms.reinforce import token_rewards_with_outcome
from mindspeed_rl.algorithms.value_loss import explained_variance
from mindspeed_rl.driver.trainer import GRPOContext, RolloutBatch, _pad, step_record, update_actor

#: Critic update metrics that are not averaged over the step's critic updates (every other one is:
#: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``, ``grad_norm``, a MoE critic's ``load_balancing_loss`` ...).
_CRITIC_NOT_MEANS = ("lr", "skipped", "update_tokens")


@dataclass
class PPOContext(GRPOContext):
    """A GRPO context plus the critic (anything with ``compute_values`` / ``update``) and the KL controller."""

    critic: Any = None
    kl_ctrl: KLController | None = None


def update_critic(
    ctx: PPOContext,
    pairs: list[Any],
    values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """``critic.ppo_epochs`` passes of the actor's mini-batches through the critic's value loss
    (``loss_mask``: 0 on a multi-turn rollout's tool tokens, which carry no value loss)."""
    cfg = ctx.config
    mini = (cfg.actor.mini_batch_size or cfg.train.global_batch) * cfg.rollout.n
    seen: dict[str, list[float]] = {}
    for _ in range(cfg.critic.ppo_epochs):
        for first in range(0, len(pairs), mini):
            part = slice(first, first + mini)
            mask = None if loss_mask is None else loss_mask[part]
            for key, value in ctx.critic.update(pairs[part], values[part], returns[part], mask).items():
                seen.setdefault(key, []).append(value)
    out = {f"critic/{k}": sum(v) / len(v) for k, v in seen.items() if k not in _CRITIC_NOT_MEANS}
    out["critic/lr"] = seen["lr"][0]
    out["critic/skipped_updates"] = sum(seen.get("skipped", [0.0]))
    return out


def ppo_train_on_batch(ctx: PPOContext, batch: RolloutBatch) -> dict[str, float]:
    """Values, KL-penalised token rewards, GAE, the actor's and the critic's updates on one batch (collective).

    ``ctx.step`` is the number of steps done: while it is below ``critic.warmup_steps`` only the
    critic is updated.

    Returns:
        The step's metrics (GRPO's, see :func:`~mindspeed_rl.driver.trainer.grpo_step`, and the critic's).
    """
    cfg = ctx.config
    algo = cfg.algorithm
    times: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[f"time/{name}"] = now - mark
        mark = now

    pairs, rewards = batch.pairs, batch.rewards
    width = max(len(r) for _, r in pairs)
    mini = (cfg.actor.mini_batch_size or cfg.train.global_batch) * cfg.rollout.n
    on_policy = cfg.actor.ppo_epochs == 1 and mini >= len(pairs)
    kl_in_reward = algo.use_kl_in_reward and ctx.reference is not None
    policy_logp = _pad(ctx.actor.compute_logprobs(pairs), width) if kl_in_reward or not on_policy else None
    old_logp = None if on_policy else policy_logp
    ref_logp = _pad(ctx.reference.compute_logprobs(pairs), width) if ctx.reference is not None else None
    lap("old_logp")
    values = _pad(ctx.critic.compute_values(pairs), width)
    lap("values")
    rollout_logp = _pad(batch.rollout_logp, width)
    mask = batch.mask(width)  # 0 on a multi-turn rollout's tool tokens
    extra: dict[str, float] = {}
    if kl_in_reward:
        assert policy_logp is not None and ref_logp is not None and ctx.kl_ctrl is not None
        kl = kl_penalty(policy_logp, ref_logp, algo.kl_in_reward_estimator)
        penalty = apply_kl_penalty(rewards, kl, mask, ctx.kl_ctrl)
        token_rewards = penalty.token_rewards
        extra["kl_in_reward"], extra["kl_coef"] = penalty.kl, penalty.kl_coef
    else:
        token_rewards = token_rewards_with_outcome(rewards, mask)
    advantages, returns = compute_value_advantages(algo.advantage, token_rewards, values, mask, algo.gamma, algo.lam)
    warmup = ctx.step < cfg.critic.warmup_steps
    loss_mask = None if batch.loss_masks is None else mask
    if loss_mask is not None:
        advantages = advantages * loss_mask
    update = {} if warmup else update_actor(ctx, pairs, old_logp, advantages, ref_logp, rollout_logp, loss_mask)
    lap("update")
    extra.update(update_critic(ctx, pairs, values, returns, loss_mask))
    lap("critic_update")
    extra["critic/vf_explained_var"] = explained_variance(returns, values, mask)
    extra["critic/returns_mean"] = float(masked_mean(returns, mask))
    extra["critic/values_mean"] = float(masked_mean(values, mask))
    extra["critic/advantages_mean"] = float(masked_mean(advantages, mask))
    extra["critic/warmup"] = 1.0 if warmup else 0.0
    return step_record(ctx, batch, update, times, extra, old_logp, rollout_logp, mask)
