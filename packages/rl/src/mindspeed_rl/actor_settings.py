"""The actor's and the critic's settings from a recipe (the driver's and the workers' one translation).

Kept out of the driver modules (``trainer``, ``runner``) so that a Ray worker builds its actor
without importing the driver.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mindspeed_rl.actor import ActorSettings
from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.critic import CriticSettings


def actor_settings(config: GRPOConfig) -> ActorSettings:
    """The actor's optimizer/batching/loss settings from a recipe."""
    a, algo = config.actor, config.algorithm
    mini = a.mini_batch_size or config.train.global_batch
    updates = config.train.steps * (config.train.global_batch // mini) * a.ppo_epochs
    return ActorSettings.adamw(
        lr=a.lr,
        min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_steps,
        lr_decay_style=a.lr_decay_style,
        lr_decay_steps=updates,
        weight_decay=a.weight_decay,
        clip_grad=a.clip_grad,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        precision=a.precision,
        micro_batch_size=a.micro_batch_size,
        share_prompt=a.share_prompt,
        max_nonfinite_steps=config.train.max_nonfinite_steps,
        seed=config.train.seed,
        loss=algo.loss,
        # Dr. GRPO's divisor is fixed for the run (not the widest response of each batch).
        loss_config=replace(algo.loss_config(), norm_length=algo.norm_length or config.rollout.max_new_tokens),
    )


def critic_settings(config: Any) -> CriticSettings:
    """The critic's optimizer, schedule, batching and value-loss settings from a PPO recipe."""
    c, a, t = config.critic, config.actor, config.train
    mini = a.mini_batch_size or t.global_batch
    updates = t.steps * (t.global_batch // mini) * c.ppo_epochs
    return CriticSettings.adamw(
        lr=c.lr,
        min_lr=c.min_lr,
        lr_warmup_steps=c.lr_warmup_steps,
        lr_decay_style=c.lr_decay_style,
        lr_decay_steps=updates,
        weight_decay=c.weight_decay,
        clip_grad=c.clip_grad,
        precision=a.precision,
        micro_batch_size=a.micro_batch_size,
        share_prompt=a.share_prompt,
        max_nonfinite_steps=t.max_nonfinite_steps,
        seed=t.seed,
        value_loss=c.value_loss,
        cliprange_value=c.cliprange_value,
    )
