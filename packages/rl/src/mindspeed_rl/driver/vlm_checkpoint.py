"""Checkpoints of a vision-language GRPO run (``actor.model_type: vlm``): the multimodal trainer's format.

The actor is a ``mindspeed_mm`` model trained by torch AdamW, so its checkpoint is the one
``mindspeed-mm train`` writes (:mod:`mindspeed_mm.trainer.checkpoint`): ``checkpoint.save/step_<N>/``
with the model's and the optimizer's tensors (torch DCP), ``trainer_state.json`` (the step, torch's
CPU random state, the model's class, and here the run's counters: the prompt sampler's position,
the policy version, the non-finite streak) and, written last, ``complete.json``; the tracker moves
after the rename, ``checkpoint.keep_last`` rotates complete checkpoints only, and a resume takes
the newest complete one (:mod:`mindspeed.checkpointing`). The rollout engine needs no state of its
own (each batch's sampling seeds follow from the step; its weights are the actor's).

``checkpoint.save_hf`` is the multimodal trainer's export (:func:`mindspeed_mm.trainer.export.save_hf`):
the model's own ``save_pretrained`` plus the source directory's tokenizer and processor files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindspeed.checkpointing.hf_dtype import target_dtype
from mindspeed.log import get_logger
from mindspeed_mm.trainer.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from mindspeed_mm.trainer.export import save_hf

logger = get_logger(__name__)

#: The prompt sampler's fields in the trainer state (``sampler_<key>``).
SAMPLER_PREFIX = "sampler_"


def save_vlm_checkpoint(ctx: Any) -> Path:
    """Write the run's checkpoint of step ``ctx.step`` to ``checkpoint.save`` (a collective; returns its directory)."""
    c, actor = ctx.config.checkpoint, ctx.actor
    counters = {SAMPLER_PREFIX + key: int(value) for key, value in ctx.sampler.state_dict().items()}
    counters.update(policy_version=int(actor.version), nonfinite_streak=int(actor.streak))
    return save_checkpoint(
        c.save, ctx.step, actor.model, actor.optimizer, c.keep_last, source=ctx.config.actor.model, counters=counters
    )


def resume_vlm(ctx: Any) -> Path | None:
    """Continue from the newest complete checkpoint of ``checkpoint.save`` (None: there is none, start at step 1).

    Restores the actor's weights and AdamW state, torch's random state, the step, the prompt
    sampler's position and the policy version, and loads the weights into the engine.

    Raises:
        ConfigError: the checkpoint is damaged, holds another model, or ``save`` has no complete one.
        ValueError: the checkpoint's sampler was for other data or another ``train.seed``.
    """
    c, actor = ctx.config.checkpoint, ctx.actor
    path = find_resume_checkpoint(c.save, c.resume)
    if path is None:
        return None
    state = load_checkpoint(path, actor.model, actor.optimizer, source=ctx.config.actor.model)
    ctx.sampler.load_state_dict(
        {key[len(SAMPLER_PREFIX) :]: value for key, value in state.items() if key.startswith(SAMPLER_PREFIX)}
    )
    ctx.step = int(state["step"])
    actor.version = int(state.get("policy_version", ctx.step))
    actor.streak = int(state.get("nonfinite_streak", 0))
    ctx.engine.load_weights(actor.hf_state())
    logger.info("vision-language GRPO resumes after step %d from %s", ctx.step, path)
    return path


def save_due(ctx: Any) -> bool:
    """Whether the recipe saves after step ``ctx.step`` (every ``checkpoint.interval`` steps and after the last)."""
    c = ctx.config.checkpoint
    return c.save is not None and (
        ctx.step == ctx.config.train.steps or bool(c.interval and ctx.step % c.interval == 0)
    )


def export_vlm(ctx: Any) -> Path | None:
    """Write the policy as a Hugging Face directory to ``checkpoint.save_hf`` (a collective; the path on rank 0)."""
    c = ctx.config.checkpoint
    return save_hf(ctx.actor.model, ctx.config.actor.model, c.save_hf, dtype=target_dtype(c.save_hf_dtype))
