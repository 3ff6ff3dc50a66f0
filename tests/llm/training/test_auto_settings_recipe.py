"""``mindspeed auto-settings`` writes a recipe ``mindspeed-llm`` accepts: its config loads it and its checks pass.

The core's search knows the LLM recipe only as plain keys (layering: the core never imports
the suite); this test holds the two together. For a tiny Llama on 1 x 2 and 2 x 4 devices,
at memory sizes where the plain layout fits and where only memory settings make it fit, the
written recipe loads strictly (unknown keys would be errors) and ``PretrainConfig.check``
accepts it at the searched world size, with the chosen layout, micro batch and features in it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mindspeed.cli import main
from mindspeed_llm.training.config import load_pretrain_config

RECIPE = {
    "model": {
        "num_layers": 8,
        "hidden_size": 256,
        "ffn_hidden_size": 704,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "vocab_size": 2048,
    },
    "data": {"seq_length": 512, "mock": True},
    "train": {"steps": 2, "micro_batch_size": 1, "global_batch_size": 16, "precision": "bf16"},
}


@pytest.mark.parametrize(("nnodes", "nproc", "gib"), [(1, 2, 4.0), (1, 2, 0.09), (2, 4, 0.05)])
def test_written_recipe_is_accepted(tmp_path: Path, nnodes: int, nproc: int, gib: float) -> None:
    config, output = tmp_path / "recipe.yaml", tmp_path / "best.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    argv = ["auto-settings", "--config", str(config), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    assert main([*argv, "--device-memory", str(gib), "--device", "100,50", "--output", str(output)]) == 0
    recipe = load_pretrain_config(output)
    recipe.check(nnodes * nproc)
    written = yaml.safe_load(output.read_text())
    assert recipe.parallel.tp == written["parallel"]["tp"] and recipe.train.global_batch_size == 16
    assert (
        recipe.features.settings["swap_optimizer"]["enabled"]
        == written["features"]["settings"]["swap_optimizer"]["enabled"]
    )


def test_printed_overrides_give_the_same_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, output = tmp_path / "recipe.yaml", tmp_path / "best.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    argv = ["auto-settings", "--config", str(config), "--nnodes", "1", "--nproc-per-node", "2"]
    assert main([*argv, "--device-memory", "0.09", "--device", "100,50", "--output", str(output)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("overrides of the best: "))
    from_keys = load_pretrain_config(config, line.removeprefix("overrides of the best: ").split())
    assert from_keys == load_pretrain_config(output)
