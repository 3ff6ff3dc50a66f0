"""Checks of PPO's keys (``algorithm.lam``, ``algorithm.kl_ctrl``, ``critic``), one line each naming key and fix.

:func:`check_gae_keys` runs for every RL recipe (from :mod:`mindspeed_rl.config.checks`): a GRPO
recipe has no critic, so PPO-only keys set there are refused rather than silently ignored.
:func:`check_critic` runs for a :class:`~mindspeed_rl.config.ppo.PPOConfig`.
"""

from __future__ import annotations

from pathlib import Path

from mindspeed.checkpointing.discovery import is_complete, list_complete
from mindspeed.config import ConfigError
from mindspeed_rl.algorithms.functional import LOSS_AGG_MODES
from mindspeed_rl.algorithms.gae import VALUE_ADVANTAGES
from mindspeed_rl.algorithms.kl_control import KL_CONTROLLERS, KLController, build_kl_controller
from mindspeed_rl.algorithms.value_loss import VALUE_LOSSES
from mindspeed_rl.config.ppo_sections import CriticConfig
from mindspeed_rl.config.sections import AlgorithmConfig, RLTrainConfig


def _names(registry: object) -> str:
    return ", ".join(map(str, registry.keys()))  # type: ignore[attr-defined]


def check_gae_keys(al: AlgorithmConfig, has_critic: bool) -> None:
    """``algorithm.lam`` and ``algorithm.kl_ctrl``; without a critic, refuse what only PPO uses."""
    if not 0 <= al.lam <= 1:
        raise ConfigError(f"algorithm.lam={al.lam} must be in [0, 1] (GAE's lambda; 0.95 is common)")
    k = al.kl_ctrl
    if k.type not in KL_CONTROLLERS:
        raise ConfigError(f"algorithm.kl_ctrl.type={k.type!r}; use one of {_names(KL_CONTROLLERS)}")
    if k.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_ctrl.kl_coef={k.kl_coef} must be >= 0")
    if k.target_kl <= 0 or k.horizon < 1:
        raise ConfigError(
            f"algorithm.kl_ctrl.target_kl={k.target_kl} must be > 0 and algorithm.kl_ctrl.horizon={k.horizon} "
            ">= 1 (verl's defaults: 0.1 and 10000)"
        )
    if has_critic:
        if al.advantage not in VALUE_ADVANTAGES:
            raise ConfigError(
                f"algorithm.advantage={al.advantage!r}: PPO with a critic takes a critic-based advantage "
                f"({_names(VALUE_ADVANTAGES)}); set algorithm.advantage=gae or use mindspeed-rl grpo"
            )
        return
    if al.advantage in VALUE_ADVANTAGES:
        raise ConfigError(
            f"algorithm.advantage={al.advantage} needs a critic, which mindspeed-rl grpo does not train; run "
            "mindspeed-rl ppo for PPO with a critic, or use grpo, rloo or reinforce_plus_plus"
        )
    if al.lam != 1.0:
        raise ConfigError(f"algorithm.lam={al.lam} is GAE's (PPO with a critic) and unused by grpo; remove it")
    if k.type != "fixed":
        raise ConfigError(
            f"algorithm.kl_ctrl.type={k.type}: grpo's KL-in-reward coefficient (algorithm.kl_ctrl.kl_coef) is "
            "fixed; set algorithm.kl_ctrl.type=fixed, or run mindspeed-rl ppo for the adaptive controller"
        )


def build_reward_kl_controller(al: AlgorithmConfig) -> KLController:
    """The controller of ``algorithm.kl_ctrl``, starting at ``kl_ctrl.kl_coef``."""
    k = al.kl_ctrl
    return build_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)


def check_critic(c: CriticConfig, train: RLTrainConfig) -> None:
    """The ``critic`` section."""
    if c.value_loss not in VALUE_LOSSES:
        raise ConfigError(f"critic.value_loss={c.value_loss!r}; use one of {_names(VALUE_LOSSES)}")
    if not c.cliprange_value > 0:
        raise ConfigError(
            f"critic.cliprange_value={c.cliprange_value} must be > 0 (verl's default 0.5; "
            "critic.value_loss=mse for no clipping)"
        )
    if c.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(f"critic.loss_agg_mode={c.loss_agg_mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
    if c.loss_agg_mode != "token-mean":
        raise ConfigError(
            f"critic.loss_agg_mode={c.loss_agg_mode!r}: the critic's update reduces its loss by token-mean only "
            "(verl's default); set critic.loss_agg_mode=token-mean"
        )
    if not c.lr > 0:
        raise ConfigError(f"critic.lr={c.lr} must be positive; give a learning rate such as critic.lr=1e-5")
    if not 0 <= c.min_lr <= c.lr:
        raise ConfigError(f"need 0 <= critic.min_lr <= critic.lr (got {c.min_lr} and {c.lr})")
    if c.lr_warmup_steps < 0 or (c.lr_warmup_steps and c.lr_warmup_steps >= train.steps):
        raise ConfigError(f"critic.lr_warmup_steps={c.lr_warmup_steps} must be in [0, train.steps={train.steps})")
    if c.weight_decay < 0 or c.clip_grad < 0:
        raise ConfigError(f"critic.weight_decay={c.weight_decay} and critic.clip_grad={c.clip_grad} must be >= 0")
    if c.ppo_epochs < 1:
        raise ConfigError(f"critic.ppo_epochs={c.ppo_epochs} must be at least 1")
    if not 0 <= c.warmup_steps < train.steps:
        raise ConfigError(
            f"critic.warmup_steps={c.warmup_steps} must be in [0, train.steps={train.steps}) (steps that train "
            "the critic alone before the actor's first update)"
        )
    if c.model is not None and not Path(c.model).exists():
        raise ConfigError(
            f"critic.model={c.model!r} does not exist: give a reward model (*ForSequenceClassification), a "
            "Hugging Face model directory, or unset it (default: actor.model)"
        )
    if c.load is not None:
        critic_checkpoint_dir(c.load)


def critic_checkpoint_dir(path: str | Path, key: str = "critic.load") -> Path:
    """The complete checkpoint ``path`` names: itself (an ``iter_*`` directory) or a save directory's newest.

    Raises:
        ConfigError: one line naming ``key``: ``path`` holds no complete checkpoint.
    """
    directory = Path(path)
    if is_complete(directory):
        return directory
    found = list_complete(directory)
    if not found:
        raise ConfigError(
            f"{key}={str(path)!r} holds no complete checkpoint; give an iter_* directory or a save directory "
            "with one (a PPO run's checkpoint.save/critic, a mindspeed-llm rm run's checkpoint.save)"
        )
    return found[-1]
