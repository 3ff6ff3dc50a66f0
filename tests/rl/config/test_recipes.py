"""Every shipped RL recipe is a valid recipe of the command it names (``grpo``, ``ppo`` or ``flow-grpo``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindspeed.config import load_config
from mindspeed_rl.config.grpo import load_grpo_config
from mindspeed_rl.config.ppo import load_ppo_config
from mindspeed_rl.config.vlm import check_vlm
from mindspeed_rl.demo.model import DEMO_MODELS
from mindspeed_rl.demo.tools_model import TOOLS_DEMO_MODEL
from mindspeed_rl.driver.flow_grpo import FlowGRPOConfig

LOADERS = {"grpo": load_grpo_config, "ppo": load_ppo_config}

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "rl").glob("*.yaml"))


def test_there_are_recipes() -> None:
    assert any(p.name == "grpo_tiny_cpu.yaml" for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_recipe_checks_and_names_its_command(path: Path, tmp_path: Path) -> None:
    named = re.findall(r"mindspeed-rl (grpo|ppo|flow-grpo) --config (\S+)", path.read_text())
    assert [file for _, file in named] == [f"examples/rl/{path.name}"]
    if named[0][0] == "flow-grpo":
        flow = load_config(FlowGRPOConfig, path)
        flow.validate()
        assert flow.iterations > 0
        return
    load = LOADERS[named[0][0]]
    config = load(path)
    (tmp_path / "config.json").write_text("{}")  # the check wants model directories: stand one in
    assert TOOLS_DEMO_MODEL in DEMO_MODELS
    if config.actor.model in DEMO_MODELS:  # demo, demo-tools (nothing is built)
        config = load(path, [f"actor.model={tmp_path}"])
    if config.reward.model is not None:  # a reward model trained first (grpo_rm_tiny_cpu.yaml)
        config = load(path, [f"actor.model={config.actor.model}", f"reward.model={tmp_path}"])
    if config.actor.model_type == "vlm":  # the demo's mllm_format files are built on first use: stand one in
        (tmp_path / "questions.jsonl").write_text("")
        data = tmp_path / "questions.jsonl"
        config = load(path, [f"actor.model={tmp_path}", f"data.path={data}", f"data.eval_path={data}"])
        check_vlm(config)
    config.check()
    assert config.train.steps > 0
