"""Every shipped LLM recipe is a valid recipe of the command its header names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindspeed_llm.training.config import load_pretrain_config

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "llm").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_recipe_parses_and_names_its_command(path: Path) -> None:
    commands = set(re.findall(r"mindspeed-llm (pretrain|sft|dpo) --config (\S+)", path.read_text()))
    assert commands, f"{path.name} does not say which command runs it"
    for stage, named in commands:
        assert named == f"examples/llm/{path.name}"
        config = load_pretrain_config(path, [f"stage={stage}"])
        config._check_lora()
        assert config.train.steps > 0
