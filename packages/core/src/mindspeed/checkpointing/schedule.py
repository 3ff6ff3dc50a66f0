"""Resuming with changed learning-rate settings: refused unless the recipe says which side wins, as megatron.

A checkpoint records the learning-rate schedule it was trained with. A resumed run whose recipe
gives another one (another peak or final learning rate, warmup, decay style, decay length or
weight decay) would otherwise follow one of the two silently. :func:`resolve_schedule` compares
the two (each trainer names its settings as the recipe spells them) and either raises one line
listing every difference and the two ways out, or returns the side that wins:

- ``checkpoint.override_scheduler=true`` (megatron's ``--override-opt_param-scheduler``): the
  recipe wins; the schedule goes on from the resumed step with the recipe's values, as a fresh
  schedule of the recipe would at that step;
- ``checkpoint.use_checkpoint_scheduler=true`` (``--use-checkpoint-opt_param-scheduler``): the
  checkpoint wins; the run continues the schedule it was started with.

Both at once is an error. Without differences neither flag matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from mindspeed.config import ConfigError
from mindspeed.log import get_logger

logger = get_logger(__name__)

#: The recipe keys of the two ways out (every suite spells them so).
OVERRIDE = "checkpoint.override_scheduler"
USE_CHECKPOINT = "checkpoint.use_checkpoint_scheduler"

Winner = Literal["recipe", "checkpoint"]


def check_scheduler_flags(override: bool, use_checkpoint: bool) -> None:
    """Raise one line when both ways out are set."""
    if override and use_checkpoint:
        raise ConfigError(
            f"{OVERRIDE}=true and {USE_CHECKPOINT}=true contradict each other: the recipe's schedule or "
            "the checkpoint's wins on resume, not both; set one of them"
        )


def schedule_differences(saved: Mapping[str, Any], recipe: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, checkpoint value, recipe value)`` for every key both record with different values, in ``recipe``'s order."""
    return [(key, saved[key], value) for key, value in recipe.items() if key in saved and saved[key] != value]


def describe_differences(differences: list[tuple[str, Any, Any]]) -> str:
    """``train.lr: checkpoint 0.003 vs recipe 0.001, ...``."""
    return ", ".join(f"{key}: checkpoint {theirs} vs recipe {ours}" for key, theirs, ours in differences)


def resolve_schedule(
    saved: Mapping[str, Any],
    recipe: Mapping[str, Any],
    checkpoint: str | Path,
    step: int,
    override: bool = False,
    use_checkpoint: bool = False,
    announce: bool = True,
) -> Winner | None:
    """Which schedule a run resumed from ``checkpoint`` follows.

    Args:
        saved: the checkpoint's schedule settings, keyed as the recipe spells them (``train.lr``);
            a key the checkpoint does not record (an older checkpoint) is not compared.
        recipe: the recipe's settings, the same keys. Settings that cannot change the learning
            rate (the decay length of a ``constant`` schedule) are left out by the caller.
        checkpoint: the checkpoint directory (for the message).
        step: the step it holds.
        override: ``checkpoint.override_scheduler``.
        use_checkpoint: ``checkpoint.use_checkpoint_scheduler``.
        announce: log one line saying which side wins when they differ (rank 0).

    Returns:
        ``None`` when the settings agree, ``"recipe"`` or ``"checkpoint"`` when a flag chose.

    Raises:
        ConfigError: they differ and no flag chose (one line: each difference and both ways out),
            or both flags are set.
    """
    check_scheduler_flags(override, use_checkpoint)
    differences = schedule_differences(saved, recipe)
    if not differences:
        return None
    listed = describe_differences(differences)
    if not (override or use_checkpoint):
        raise ConfigError(
            f"checkpoint {checkpoint} was trained with another learning-rate schedule than the recipe's ({listed}); "
            f"set {OVERRIDE}=true to go on from step {step} with the recipe's values, or "
            f"{USE_CHECKPOINT}=true to keep the checkpoint's schedule"
        )
    winner: Winner = "recipe" if override else "checkpoint"
    if announce:
        logger.info(
            "%s=true: resuming at step %d with the %s's learning-rate schedule (%s)",
            OVERRIDE if override else USE_CHECKPOINT,
            step,
            winner,
            listed,
        )
    return winner
