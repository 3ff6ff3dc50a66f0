"""The recipe sections PPO with a critic adds: ``algorithm.kl_ctrl`` and ``critic``.

Kept apart from :mod:`mindspeed_rl.config.sections` so the GRPO sections stay as they are;
:class:`KLControlConfig` is a field of ``AlgorithmConfig`` (``algorithm.kl_ctrl``) and
:class:`CriticConfig` the ``critic`` section of :class:`~mindspeed_rl.config.ppo.PPOConfig`.
The checks are :func:`mindspeed_rl.config.ppo_checks.check_ppo_sections`.

The math these keys drive is in :mod:`mindspeed_rl.algorithms` (``gae``, ``kl_control``,
``value_loss``); the critic that reads the rest of ``critic`` is :mod:`mindspeed_rl.models.critic`, built
from it by :func:`mindspeed_rl.models.actor_settings.critic_settings` (docs/rl/ppo.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The KL-in-reward coefficient's default (verl's ``algorithm.kl_ctrl.kl_coef``).
KL_COEF_DEFAULT = 0.001


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty folded into the per-token reward (verl's ``algorithm.kl_ctrl``).

    ``kl_ctrl.kl_coef`` is the one key of that coefficient for every recipe with
    ``algorithm.use_kl_in_reward`` (PPO, REINFORCE++); ``algorithm.kl_in_reward_coef`` is its old
    spelling (moved here with one warning line).

    Attributes:
        type: ``fixed`` (the coefficient stays ``kl_coef``) or ``adaptive`` (Ziegler et al.'s
            proportional controller: ``kl_coef *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon``
            after each batch of ``n`` responses).
        kl_coef: the (initial) coefficient.
        target_kl: the KL the adaptive controller steers towards.
        horizon: the adaptive controller's horizon, in responses.
    """

    type: str = "fixed"
    kl_coef: float = KL_COEF_DEFAULT
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class CriticConfig:
    """The value model of PPO (a GPT whose output layer is a scalar value head) and its training.

    Attributes:
        model: where it starts: a Hugging Face ``*ForSequenceClassification`` directory (a reward
            model: its score head becomes the value head) or a ``*ForCausalLM`` directory (the value
            head is drawn fresh); default ``actor.model``.
        load: a Megatron checkpoint whose weights then start the critic (an ``iter_*`` directory
            or a save directory's newest complete one: a PPO run's ``checkpoint.save/critic``, a
            ``mindspeed-llm rm`` run's ``checkpoint.save``); ``critic.model`` gives its shape.
        value_loss: a key of ``VALUE_LOSSES``: ``clipped`` (verl/OpenRLHF) or ``mse``.
        cliprange_value: the clip range of the value predictions around the rollout's values.
        loss_agg_mode: how the per-token value loss is reduced (``token-mean``, verl's default).
        lr, min_lr, lr_warmup_steps, lr_decay_style, weight_decay, clip_grad: its optimizer and
            schedule, as the actor's keys.
        ppo_epochs: passes over each rollout batch.
        warmup_steps: steps that train the critic alone before the actor's first update.
        colocate: share the actor's devices (MindSpeed-RL's default); false: a pool of its own (as
            many devices as the actor's, the actor's layout), which the rollout never offloads.
    """

    model: str | None = None
    load: str | None = None
    value_loss: str = "clipped"
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    lr: float = 1e-5
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    ppo_epochs: int = 1
    warmup_steps: int = 0
    colocate: bool = True
