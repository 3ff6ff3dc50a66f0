"""The GRPO driver's checkpoints: when to save, a save refused for NaN/Inf state, the newest
checkpoint, a run stopped by non-finite updates in a row, and the Hugging Face export.

:class:`RunnerCheckpoints` is a part of :class:`~mindspeed_rl.driver.runner.GRPORunner`: it reads the
runner's ``config``, ``ctx`` (its step), ``version``, ``sampler_state`` and actor ``group``,
and sets ``saved_step`` and ``failed``. A checkpoint is the actor's (the LLM suite's format)
plus :data:`RL_STATE` (step, policy version, prompt-sampler position), marked complete last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mindspeed.checkpointing import NonFiniteState, SkipCounter, checkpoint_dir, find_resume
from mindspeed.log import get_logger

logger = get_logger("mindspeed_rl.driver.runner")

#: The run state file of a checkpoint (step, policy version, sampler position).
RL_STATE = "rl_state.json"


class RunnerCheckpoints:
    """Saving, the newest checkpoint and the stop on diverged updates of the GRPO driver."""

    config: Any
    ctx: Any
    group: Any
    version: int
    sampler_state: Any
    saved_step: int | None
    failed: str | None

    def newest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint in ``checkpoint.save`` (what the same command resumes from)."""
        save = self.config.checkpoint.save
        return find_resume(save, warn=False).path if save is not None and Path(save).is_dir() else None

    def _diverged(self, record: dict[str, float]) -> bool:
        """Whether the actor's updates were refused ``train.max_nonfinite_steps`` times in a row (sets :attr:`failed`)."""
        t = self.config.train
        streak = int(record.get("nonfinite_streak", 0))
        if streak < max(t.max_nonfinite_steps, 1):
            return False
        where = self.checkpoint_path()
        a = self.config.actor
        per_step = t.global_batch // (a.mini_batch_size or t.global_batch) * a.ppo_epochs
        skips = SkipCounter(t.max_nonfinite_steps, lr_key="actor.lr", unit="actor update", streak=streak)
        self.failed = skips.stop_line(
            self.ctx.step * per_step,
            self.config.actor.lr,
            f"it resumes from {where}" if where is not None else "no checkpoint was saved, it starts from step 1",
        )
        return True

    def _maybe_save(self) -> bool:
        """Save when the recipe says; ``False`` when the save was refused for NaN/Inf state (sets :attr:`failed`)."""
        c = self.config.checkpoint
        if c.save is None:
            return True
        step = self.ctx.step
        if step == self.config.train.steps or (c.interval and step % c.interval == 0):
            return self._save_or_fail(c.save)
        return True

    def _save_or_fail(self, root: str) -> bool:
        """:meth:`save`; ``False`` when it was refused for NaN/Inf state (sets :attr:`failed`)."""
        try:
            self.save(root)
        except NonFiniteState as err:  # raised by every actor rank, through Ray: keep its own one line
            self.failed = str(getattr(err, "cause", None) or err).strip().splitlines()[-1]
            return False
        return True

    def save(self, root: str | Path) -> Path:
        """Save the run as ``root/iter_<step>`` (actor + ``rl_state.json``, marked complete last);
        rotates complete checkpoints to ``checkpoint.keep_last``."""
        state = self._run_state()
        path = Path(
            self.group.call(
                "save", str(root), self.ctx.step, {RL_STATE: json.dumps(state)}, self.config.checkpoint.keep_last
            )[0]
        )
        self.saved_step = self.ctx.step
        logger.info("saved %s", path)
        return path

    def _run_state(self) -> dict[str, Any]:
        """What :data:`RL_STATE` records: step, policy version, sampler position (PPO's adds the KL controller)."""
        return {"step": self.ctx.step, "version": self.version, "sampler": self.sampler_state}

    def checkpoint_path(self) -> Path | None:
        """The newest checkpoint this run saved or resumed from (``None``: none)."""
        save = self.config.checkpoint.save
        return checkpoint_dir(save, self.saved_step) if save is not None and self.saved_step is not None else None

    def save_hf(self, target: str | Path) -> str:
        """Write the current policy as a Hugging Face directory (a LoRA actor's merged weights)."""
        return self.group.call("save_hf", str(target))[0]

    def save_peft(self, target: str | Path) -> str:
        """Write a LoRA actor's adapter as a PEFT adapter directory for its Hugging Face base."""
        self.group.call("save_peft", str(target))
        return str(target)
