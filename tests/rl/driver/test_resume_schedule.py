"""The GRPO driver checks the actor's learning-rate schedule against a checkpoint's before the workers load it.

A checkpoint directory whose ``common.pt`` holds the actor scheduler's state of a recipe with
``actor.lr=2e-3`` and a cosine decay (what the actor workers save) is checked against recipes: the
same one passes; ``actor.lr=1e-3`` or more ``train.steps`` (a longer decay) is one line listing the
difference and both ways out; a flag passes and is handed on to the workers' load; both flags are an
error. (The workers' load itself is the LLM trainer's, proven numerically in
``tests/llm/training/test_resume_schedule.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mindspeed.config import ConfigError
from mindspeed_llm.training.optim import scheduler_state
from mindspeed_rl.config.grpo import load_grpo_config
from mindspeed_rl.driver.runner import check_actor_schedule
from mindspeed_rl.models.actor_settings import actor_settings

OLD = ["actor.lr=2e-3", "actor.min_lr=1e-4", "actor.lr_decay_style=cosine", "train.steps=4"]


def test_the_driver_refuses_a_changed_actor_schedule_unless_told_which_wins(tmp_path: Path) -> None:
    old = actor_settings(load_grpo_config(None, OLD)).scheduler
    checkpoint = tmp_path / "iter_0000002"
    checkpoint.mkdir()
    torch.save(
        {"opt_param_scheduler": {**scheduler_state(old, old.lr_warmup_steps + 1), "num_steps": 2}},
        checkpoint / "common.pt",
    )

    assert check_actor_schedule(load_grpo_config(None, OLD), checkpoint, 2) == (False, False)
    with pytest.raises(ConfigError) as refused:
        check_actor_schedule(load_grpo_config(None, [*OLD, "actor.lr=1e-3"]), checkpoint, 2)
    line = str(refused.value)
    assert f"checkpoint {checkpoint} was trained with another learning-rate schedule" in line and "\n" not in line
    assert "actor.lr: checkpoint 0.002 vs recipe 0.001" in line and "decay length" not in line
    assert "checkpoint.override_scheduler=true" in line and "checkpoint.use_checkpoint_scheduler=true" in line
    with pytest.raises(ConfigError, match=r"the decay length \(train.steps x updates per step\): checkpoint 4 vs"):
        check_actor_schedule(load_grpo_config(None, [*OLD, "train.steps=6"]), checkpoint, 2)

    override = load_grpo_config(None, [*OLD, "actor.lr=1e-3", "checkpoint.override_scheduler=true"])
    assert check_actor_schedule(override, checkpoint, 2) == (True, False)
    keep = load_grpo_config(None, [*OLD, "actor.lr=1e-3", "checkpoint.use_checkpoint_scheduler=true"])
    assert check_actor_schedule(keep, checkpoint, 2) == (False, True)
    both = [*OLD, "checkpoint.override_scheduler=true", "checkpoint.use_checkpoint_scheduler=true"]
    with pytest.raises(ConfigError, match="contradict each other"):
        check_actor_schedule(load_grpo_config(None, both), checkpoint, 2)
