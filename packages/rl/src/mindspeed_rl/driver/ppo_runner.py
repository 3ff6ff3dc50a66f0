"""The PPO driver: the GRPO driver (:class:`~mindspeed_rl.driver.runner.GRPORunner`) with a critic and a KL controller.

Same pools, workers, replay buffer, rollout and rewards as ``grpo``; the actor workers also hold
the critic's shards (co-located with the actor: its resource pool, its devices, its layout;
:class:`~mindspeed_rl.workers.critic_view.CriticView`), or, with ``critic.colocate: false``, the
critic runs in a pool of its own (as many devices as the actor's, the actor's layout, its own
process group), and each step trains on the batch with
:func:`~mindspeed_rl.driver.ppo_trainer.ppo_train_on_batch` (values, KL in the reward, GAE, the actor's
and the critic's updates).

Checkpoints: the critic is saved first as ``checkpoint.save/critic/iter_<step>`` (weights,
optimizer, scheduler), then the actor's run checkpoint ``checkpoint.save/iter_<step>``, whose
``rl_state.json`` also holds the KL controller's coefficient and is marked complete last: a run
checkpoint that is complete has its critic. The critic's directory keeps one checkpoint more than
``checkpoint.keep_last`` so the critic of every complete run checkpoint survives its rotation.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mindspeed.config import ConfigError
from mindspeed.log import get_logger
from mindspeed.megatron.trusted_load import check_dist_checkpoint
from mindspeed_rl.config.ppo import PPOConfig
from mindspeed_rl.driver.ppo_trainer import PPOContext, ppo_train_on_batch
from mindspeed_rl.driver.runner import GRPORunner, _absolute, find_run_checkpoint
from mindspeed_rl.driver.trainer import GRPOContext, RolloutBatch
from mindspeed_rl.workers.critic_view import CriticView
from mindspeed_rl.workers.group import ActorGroup
from mindspeed_rl.workers.pools import ResourcePool

logger = get_logger(__name__)

#: Where the critic's checkpoints go, under ``checkpoint.save``.
CRITIC_DIR = "critic"


class PPORunner(GRPORunner):
    """A PPO run on Ray (see the module docstring).

    Args:
        config: the PPO recipe (checked before any worker starts).

    Raises:
        ConfigError: the recipe's first problem; a resumed checkpoint without its critic.
    """

    config: PPOConfig

    def __init__(self, config: PPOConfig) -> None:
        # Ray workers do not share the driver's cwd.
        c = config.critic
        config = replace(config, critic=replace(c, model=_absolute(c.model), load=_absolute(c.load)))
        check_critic_checkpoint(config)  # before any worker starts: one line
        super().__init__(config)

    def _more_workers(self) -> int:
        return 0 if self.config.critic.colocate else self.config.actor_world_size()

    def _start_more_workers(self, model_dir: str) -> None:
        self.critic_group = self.group
        if not self.config.critic.colocate:
            pinned = self.config.ray.pool_resources.get("critic", {})
            self.pools.append(ResourcePool("critic", self.config.actor_world_size(), pinned).create())
            self.critic_group = ActorGroup(self.config, model_dir, self.pools[-1], role="critic")
            logger.info("the critic runs in its own pool: %d workers", len(self.critic_group.workers))

    def _trainer_workers(self) -> list[Any]:
        separate = self.critic_group is not self.group
        return super()._trainer_workers() + (list(self.critic_group.workers) if separate else [])

    def _phase_stats(self) -> dict[str, float]:
        stats = super()._phase_stats()
        if self.critic_group is not self.group:
            stats.update(self.critic_group.phase_stats())
        return stats

    def _context(self, *pieces: Any) -> GRPOContext:
        return PPOContext(*pieces, critic=CriticView(self.critic_group), kl_ctrl=self.config.reward_kl_controller())

    def _train_on_batch(self, batch: RolloutBatch) -> dict[str, float]:
        return ppo_train_on_batch(self.ctx, batch)  # type: ignore[arg-type]

    def _run_state(self) -> dict[str, Any]:
        state = super()._run_state()
        state["kl_ctrl"] = self.ctx.kl_ctrl.state_dict()  # type: ignore[attr-defined]
        return state

    def save(self, root: str | Path) -> Path:
        """Save the critic, then the run checkpoint (actor + run state, marked complete last)."""
        keep = self.config.checkpoint.keep_last
        self.critic_group.call(
            "save_critic", str(Path(root) / CRITIC_DIR), self.ctx.step, None if keep is None else keep + 1
        )
        return super().save(root)

    def _load_actor(self, path: Path, flags: tuple[bool, bool], step: int) -> None:
        # Through critic.warmup_steps the actor took no update: its saved optimizer has no state to load.
        self.group.call("load", str(path), *flags, step > self.config.critic.warmup_steps)

    def _maybe_resume(self, resume: tuple[Path, dict[str, Any]] | None) -> None:
        if resume is not None:
            path, state = resume
            critic = critic_checkpoint(path)
            if "kl_ctrl" in state:
                self.ctx.kl_ctrl.load_state_dict(state["kl_ctrl"])  # type: ignore[attr-defined]
            self.critic_group.call("load_critic", str(critic))
        super()._maybe_resume(resume)


def critic_checkpoint(run_checkpoint: Path) -> Path:
    """The critic's checkpoint that belongs to run checkpoint ``save/iter_<step>``: ``save/critic/iter_<step>``."""
    return run_checkpoint.parent / CRITIC_DIR / run_checkpoint.name


def check_critic_checkpoint(config: PPOConfig) -> None:
    """The run checkpoint a resume would take has its critic, whose files are safe to read (in the driver).

    Raises:
        ConfigError: one line: the critic's directory is missing, or a file in it is refused.
    """
    found = find_run_checkpoint(config.checkpoint)
    if found is None:
        return
    path = found[0]
    critic = critic_checkpoint(path)
    if not critic.is_dir():
        raise ConfigError(
            f"checkpoint {path} has no critic ({critic} is missing); set checkpoint.resume=false to start "
            "from step 1 or set checkpoint.save to a new directory"
        )
    check_dist_checkpoint(critic)
