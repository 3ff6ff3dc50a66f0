"""The actor's and the critic's settings from a recipe (the driver's and the workers' one translation).

Kept out of the driver modules (``trainer``, ``runner``) so that a Ray worker builds its actor
without importing the driver.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mindspeed_llm.engine import LoraSettings
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.ppo_checks import critic_checkpoint_dir
from mindspeed_rl.models.actor import Actor, ActorSettings
from mindspeed_rl.models.actor_lora import AdapterOffReference
from mindspeed_rl.models.critic import Critic, CriticSettings


def _optimizer_and_batching(section: Any, config: Any, epochs: int) -> dict[str, Any]:
    """The AdamW schedule of ``section`` (``actor`` or ``critic``) and the batching both models share.

    The schedule decays over every update of the run: steps x mini-batches per step x ``epochs``.
    """
    a, t = config.actor, config.train
    mini = a.mini_batch_size or t.global_batch
    return {
        "lr": section.lr,
        "min_lr": section.min_lr,
        "lr_warmup_steps": section.lr_warmup_steps,
        "lr_decay_style": section.lr_decay_style,
        "lr_decay_steps": t.steps * (t.global_batch // mini) * epochs,
        "weight_decay": section.weight_decay,
        "clip_grad": section.clip_grad,
        "precision": a.precision,
        "micro_batch_size": a.micro_batch_size,
        "share_prompt": a.share_prompt,
        "compile": a.compile,
        "max_nonfinite_steps": t.max_nonfinite_steps,
        "seed": t.seed,
    }


def lora_settings(config: GRPOConfig) -> LoraSettings | None:
    """The actor's LoRA (``actor.lora``; None while it is off), its factors seeded by ``train.seed``."""
    lo = config.actor.lora
    if not lo.enabled:
        return None
    return LoraSettings(
        r=lo.r, alpha=lo.alpha, dropout=lo.dropout, target_modules=tuple(lo.target_modules), seed=config.train.seed
    )


def actor_settings(config: GRPOConfig) -> ActorSettings:
    """The actor's optimizer/batching/loss settings from a recipe."""
    a, algo = config.actor, config.algorithm
    return ActorSettings.adamw(
        **_optimizer_and_batching(a, config, a.ppo_epochs),
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        loss=algo.loss,
        # Dr. GRPO's divisor is fixed for the run (not the widest response of each batch).
        loss_config=replace(algo.loss_config(), norm_length=algo.norm_length or config.rollout.max_new_tokens),
        lora=lora_settings(config),
    )


def critic_settings(config: Any) -> CriticSettings:
    """The critic's optimizer, schedule, batching and value-loss settings from a PPO recipe."""
    c = config.critic
    return CriticSettings.adamw(
        **_optimizer_and_batching(c, config, c.ppo_epochs), value_loss=c.value_loss, cliprange_value=c.cliprange_value
    )


def build_critic(config: Any, model_dir: str) -> Critic:
    """PPO's critic of a recipe on this rank (collective): built from ``critic.model`` (default
    ``model_dir``), then started from ``critic.load``'s weights when it names a checkpoint."""
    a, c = config.actor, config.critic
    critic = Critic(c.model or model_dir, critic_settings(config), tp=a.tp, pp=a.pp, features=config.features)
    if c.load is not None:
        critic.load_weights(critic_checkpoint_dir(c.load))
    return critic


def build_reference(config: GRPOConfig, actor: Actor, model_dir: str) -> Actor | AdapterOffReference | None:
    """The KL reference of a recipe (collective), ``None`` without a KL penalty.

    A LoRA actor's reference is the actor itself with its adapters off (no second model in
    memory); otherwise a frozen actor of ``reference.model`` (default: ``model_dir``) in the
    actor's layout.
    """
    if not config.needs_reference():
        return None
    if actor.lora:
        return AdapterOffReference(actor)
    a = config.actor
    return Actor(
        config.reference.model or model_dir, actor.settings, trainable=False, tp=a.tp, pp=a.pp, features=config.features
    )
