"""Typed configs of a GRPO recipe: one dataclass per section of the YAML file (in
:mod:`mindspeed_rl.config.sections`), gathered in :class:`GRPOConfig`.

``GRPOConfig`` is the single source of truth: a recipe is a YAML mapping of its fields and
``key=value`` overrides use dotted paths (``rollout.n=8``); unknown keys are errors with a
suggestion (:func:`mindspeed.config.load_config`). :meth:`GRPOConfig.check` then checks the
values against each other, the registries and the files they name, before any worker starts,
and names the key and the fix of the first problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mindspeed.checkpointing.config import CheckpointConfig
from mindspeed.config import ConfigError, load_config
from mindspeed.features import FeaturesConfig
from mindspeed_rl.config.checks import check_config
from mindspeed_rl.config.sections import (
    SECTIONS,
    ActorConfig,
    AlgorithmConfig,
    BufferConfig,
    PromptDataConfig,
    RayConfig,
    ReferenceConfig,
    RewardConfig,
    RLLoggingConfig,
    RLTrainConfig,
    RolloutConfig,
)


@dataclass
class GRPOConfig:
    """A GRPO (or DAPO) recipe. Sections: see :data:`SECTIONS`."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    logging: RLLoggingConfig = field(default_factory=RLLoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: The actor's (and reference's) optimization level and feature settings, as an LLM recipe's.
    features: FeaturesConfig = field(default_factory=FeaturesConfig)

    def actor_world_size(self) -> int:
        """Devices of the actor: ``tp x pp x dp``."""
        return self.actor.world_size()

    def rows_per_step(self) -> int:
        """Responses per step: prompts x samples per prompt."""
        return self.train.global_batch * self.rollout.n

    def needs_reference(self) -> bool:
        """Whether a reference policy is needed (a KL penalty with a positive coefficient)."""
        return self.algorithm.needs_reference()

    def log_dir(self) -> Path | None:
        """Where metrics are written (``logging.dir``, else ``checkpoint.save``)."""
        target = self.logging.dir or self.checkpoint.save
        return Path(target) if target else None

    def check(self, num_devices: int | None = None) -> None:
        """Check the recipe before any worker starts.

        Args:
            num_devices: devices the cluster offers (checked against the layout when given).

        Raises:
            ConfigError: naming the key and the fix of the first problem found.
        """
        check_config(self, num_devices)


def load_grpo_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """Read a recipe (YAML) and apply ``key=value`` overrides; does not :meth:`~GRPOConfig.check` it.

    Raises:
        ConfigError: unknown keys (with a suggestion), wrong types, a missing or invalid file.
    """
    return load_config(GRPOConfig, path, overrides)


__all__ = [
    "SECTIONS",
    "ActorConfig",
    "AlgorithmConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ConfigError",
    "GRPOConfig",
    "PromptDataConfig",
    "RLLoggingConfig",
    "RLTrainConfig",
    "RayConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "load_grpo_config",
]
