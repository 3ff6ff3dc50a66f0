"""PPO in one process: :func:`train_ppo`, the in-process twin of :func:`~mindspeed_rl.driver.trainer.train_grpo`.

The same pieces as ``mindspeed-rl ppo`` (:class:`~mindspeed_rl.driver.ppo_runner.PPORunner`) without
Ray: the actor, the reference, the critic (:class:`~mindspeed_rl.models.critic.Critic`, built as the
actor workers build it) and the rollout engine live in the calling process (one rank, or every
rank of an initialised group), and each step is the rollout
(:func:`~mindspeed_rl.driver.trainer.collect_rollout`), :func:`~mindspeed_rl.driver.ppo_trainer.ppo_train_on_batch`
and the weight sync: the same numbers as the command on one rank (the demo recipe's first 6 steps:
reward, losses and critic metrics equal to the last bit, the step means to 1 ulp). Used by tests
(tests/rl/driver/test_ppo_reward_rise.py) and scripts that want a PPO run without a Ray instance;
checkpoints and resume are the command's.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from mindspeed.log import get_logger
from mindspeed_rl.config.ppo import PPOConfig
from mindspeed_rl.data import load_prompts
from mindspeed_rl.driver.ppo_trainer import PPOContext, ppo_train_on_batch
from mindspeed_rl.driver.trainer import build_context, collect_rollout, eval_due, evaluate, finish_record, sync_weights
from mindspeed_rl.models.actor_settings import build_critic
from mindspeed_rl.models.memory import freeze_startup_objects

logger = get_logger(__name__)


def build_ppo_context(config: PPOConfig) -> PPOContext:
    """GRPO's context (actor, reference, engine, prompts, rewards) plus the critic and the KL controller.

    Raises:
        ConfigError / ValueError: the recipe's first problem (see :meth:`PPOConfig.check`).
    """
    base = build_context(config)  # checks the recipe, joins or starts the process group
    critic = build_critic(config, config.actor.model)
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
    return PPOContext(**fields, critic=critic, kl_ctrl=config.reward_kl_controller())


def ppo_step(ctx: PPOContext) -> dict[str, float]:
    """One PPO step in this process: rollout, :func:`ppo_train_on_batch`, weight sync (collective)."""
    import time

    start = time.perf_counter()
    batch = collect_rollout(ctx)
    rollout_time = time.perf_counter() - start
    record = ppo_train_on_batch(ctx, batch)
    record["time/rollout"] = rollout_time
    mark = time.perf_counter()
    sync_weights(ctx)
    record["time/weight_sync"] = time.perf_counter() - mark
    return finish_record(ctx, batch, record, time.perf_counter() - start)


def _append(log_dir: Path | None, record: dict[str, float]) -> None:
    if log_dir is not None:
        with open(log_dir / "metrics.jsonl", "a", encoding="utf-8") as sink:
            sink.write(json.dumps(record) + "\n")


def train_ppo(config: PPOConfig) -> list[dict[str, float]]:
    """Run ``train.steps`` PPO steps of ``config`` in this process.

    Returns:
        The metrics of every step (GRPO's and the critic's, see
        :func:`~mindspeed_rl.driver.ppo_trainer.ppo_train_on_batch`); with a log directory also appended to
        its ``metrics.jsonl``, with the held-out evaluations (step 0, every ``train.eval_interval``
        steps, the last) as ``train_grpo`` writes them.
    """
    ctx = build_ppo_context(config)
    freeze_startup_objects()
    held_out = load_prompts(config.data.eval_path, config.data.map_keys or None) if config.train.eval_interval else []
    log_dir = config.log_dir()
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    try:
        if held_out:  # the starting policy, as step 0
            _append(log_dir, {"step": 0.0, **evaluate(ctx, held_out)})
        for _ in range(config.train.steps):
            record = ppo_step(ctx)
            if held_out and eval_due(ctx.step, config.train):
                record.update(evaluate(ctx, held_out))
            _append(log_dir, record)
            if ctx.step % max(config.logging.interval, 1) == 0:
                logger.info(
                    "step %d: reward %.3f, vf_loss %.4g, explained var %.3f, %.2f s",
                    ctx.step,
                    record["reward_mean"],
                    record.get("critic/vf_loss", float("nan")),
                    record.get("critic/vf_explained_var", float("nan")),
                    record["time/step"],
                )
    finally:
        ctx.actor.close()  # undo the adaptation of megatron-core (the reference and the critic share it)
        gc.unfreeze()
    return ctx.history
