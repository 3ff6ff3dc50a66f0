"""The typed config of a PPO recipe: a GRPO recipe plus a ``critic`` section, with GAE by default.

Read by ``mindspeed-rl ppo`` (:mod:`mindspeed_rl.driver.ppo_cli`, :class:`~mindspeed_rl.driver.ppo_runner.PPORunner`;
docs/rl/ppo.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mindspeed.config import load_config
from mindspeed_rl.algorithms.kl_control import KLController
from mindspeed_rl.config.grpo import GRPOConfig
from mindspeed_rl.config.ppo_checks import build_reward_kl_controller, check_critic
from mindspeed_rl.config.ppo_sections import CriticConfig
from mindspeed_rl.config.sections import AlgorithmConfig


@dataclass
class PPOAlgorithmConfig(AlgorithmConfig):
    """PPO's ``algorithm`` section: :class:`~mindspeed_rl.config.sections.AlgorithmConfig` with GAE by default."""

    advantage: str = "gae"


@dataclass
class PPOConfig(GRPOConfig):
    """A PPO recipe: the GRPO sections (``algorithm.advantage`` defaults to ``gae``) and ``critic``."""

    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)

    def check(self, num_devices: int | None = None) -> None:
        """The GRPO checks (with a critic: GAE accepted, ``rollout.n`` 1 allowed), then the critic's.

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        super().check(num_devices)
        check_critic(self.critic, self.train)

    def needs_reference(self) -> bool:
        """A KL in the loss, or in the reward with a positive starting coefficient (``kl_ctrl.kl_coef`` too)."""
        al = self.algorithm
        return super().needs_reference() or (al.use_kl_in_reward and self.reward_kl_controller().value > 0)

    def reward_kl_controller(self) -> KLController:
        """The controller of the KL folded into the reward (``algorithm.kl_ctrl``)."""
        return build_reward_kl_controller(self.algorithm)


def load_ppo_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PPOConfig:
    """Read a PPO recipe (YAML) and apply ``key=value`` overrides; does not :meth:`~PPOConfig.check` it.

    Raises:
        ConfigError: unknown keys (with a suggestion), wrong types, a missing or invalid file.
    """
    return load_config(PPOConfig, path, overrides)
