"""``actor.lora``: the LLM suite's keys and checks under the actor, one line per bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed.config import ConfigError
from mindspeed_rl.config.grpo import load_grpo_config
from mindspeed_rl.models.actor_settings import actor_settings

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_lora_tiny_cpu.yaml"


def _config(tmp_path: Path, *overrides: str):
    (tmp_path / "config.json").write_text("{}")  # the check wants a model directory: stand one in
    return load_grpo_config(RECIPE, [f"actor.model={tmp_path}", *overrides])


def test_recipe_lora_reaches_the_actor_settings(tmp_path: Path) -> None:
    config = _config(tmp_path, "actor.lora.r=4", "actor.lora.alpha=12")
    config.check()
    lora = actor_settings(config).lora
    assert (lora.r, lora.alpha, lora.scaling, lora.seed) == (4, 12.0, 3.0, config.train.seed)
    assert lora.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert actor_settings(_config(tmp_path, "actor.lora.target_modules=[]", "actor.lora.save_peft=null")).lora is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.lora.r=0", "actor.lora: lora_r must be an integer >= 1, got 0"),
        ("actor.lora.alpha=0", "actor.lora: lora_alpha must be > 0"),
        ("actor.lora.dropout=1.5", "actor.lora: lora_dropout must be in [0, 1)"),
        ("actor.lora.target_modules=[q_proj]", "known megatron module names: linear_qkv"),
        ("actor.lora.qlora=true", "actor.lora.qlora is not supported by RL yet"),
        ("actor.lora.save_adapter=x", "use actor.lora.save_peft"),
        ("reference.model=/elsewhere", "the reference is the actor with its adapters off"),
    ],
)
def test_bad_lora_values_are_one_line(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, override).check()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_save_peft_needs_targets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora.save_peft needs LoRA: set lora.target_modules"):
        _config(tmp_path, "actor.lora.target_modules=[]").check()
