"""Every shipped LLM recipe is a valid recipe of the command its header names.

Each recipe goes through what ``mindspeed-llm <command> --config`` does before any rank starts:
load with the command's stage, read the model from ``checkpoint.load_hf`` (a tiny Llama where
the quickstart's would be) and :meth:`PretrainConfig.check` at one and two processes, in a
directory holding the data files the recipe's header tells how to make.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.finetune_data import INSTRUCTION_KEYS, PAIRWISE_KEYS
from mindspeed_llm.training.hf import apply_load_hf

#: The models the recipes start from (``checkpoint.load_hf``), each made by a command in the recipe's header.
STARTS = ("runs/quickstart/hf", "runs/demo-policy")
EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "llm").glob("*.yaml"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quickstart") / "hf"
    save_tiny_checkpoint("llama2", path)
    return path


def _make_data(stage: str, prefixes: list[str]) -> None:
    """Empty .bin/.idx files where preprocess-data would write them (check() only looks for them)."""
    for prefix in prefixes:
        if stage == "pretrain":
            names = [prefix]
        else:
            names = [
                f"{prefix}_packed_{key}_document"
                for key in (PAIRWISE_KEYS if stage in ("dpo", "rm") else INSTRUCTION_KEYS)
            ]
        for name in names:
            for suffix in (".bin", ".idx"):
                Path(name + suffix).parent.mkdir(parents=True, exist_ok=True)
                Path(name + suffix).touch()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_recipe_passes_the_checks_of_its_command(
    path: Path, hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = set(re.findall(r"mindspeed-llm (pretrain|sft|dpo|rm) --config (\S+)", path.read_text()))
    assert commands, f"{path.name} does not say which command runs it"
    monkeypatch.chdir(tmp_path)
    for stage, named in commands:
        assert named == f"examples/llm/{path.name}"
        config = dataclasses.replace(load_pretrain_config(path, [f"stage={stage}"]), stage=stage)
        if config.checkpoint.load_hf:
            # The quickstart's model, or (the reward-model demo) the RL demo policy, which knows the sums.
            assert config.checkpoint.load_hf in STARTS, f"the recipes start from one of {STARTS}"
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, load_hf=str(hf_dir)))
        config = apply_load_hf(config)
        _make_data(stage, config.data.prefixes)
        if config.data.input:  # raw records the header tells how to write
            Path(config.data.input).parent.mkdir(parents=True, exist_ok=True)
            Path(config.data.input).touch()
        p = config.parallel
        for world_size in (1, 2):
            if world_size % (p.tp * p.pp * p.cp) == 0:  # a layout that does not fit the world is refused
                config.check(world_size)
        assert config.train.steps > 0
