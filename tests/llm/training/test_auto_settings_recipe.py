"""``mindspeed auto-settings`` writes a recipe ``mindspeed-llm`` accepts: its config loads it and its checks pass.

The core's search knows the LLM recipe only as plain keys (layering: the core never imports
the suite); this test holds the two together. For a tiny Llama on 1 x 2 and 2 x 4 devices,
at memory sizes where the plain layout fits and where only memory settings make it fit, the
written recipe loads strictly (unknown keys would be errors) and ``PretrainConfig.check``
accepts it at the searched world size, with the chosen layout, micro batch and features in it.
The launch lines it prints (our launcher and ``torchrun --standalone`` on one node, ``torchrun``
with a c10d rendezvous on several) parse with torchrun's and ``mindspeed-llm``'s real parsers,
ask for the searched nodes and devices, and load the written recipe with its layout.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

from mindspeed.cli import main
from mindspeed.suite_cli import parse_suite_args
from mindspeed_llm.cli import build_parser as llm_parser
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


@pytest.mark.parametrize(("nnodes", "nproc"), [(1, 2), (2, 4)])
def test_printed_launch_lines_run_the_written_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nnodes: int, nproc: int
) -> None:
    config, output = tmp_path / "recipe.yaml", tmp_path / "best.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    argv = ["auto-settings", "--config", str(config), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    assert main([*argv, "--device-memory", "0.05", "--device", "100,50", "--output", str(output), "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["launch"]
    written = load_pretrain_config(output)
    launchers = []
    for line in lines:
        tokens = shlex.split(line)
        if tokens[0] == "torchrun":
            run = torchrun_parser().parse_args(tokens[1:])
            assert run.module and run.training_script == "mindspeed_llm.cli"
            assert (run.nnodes, run.nproc_per_node) == ("1:1" if nnodes == 1 else str(nnodes), str(nproc))
            assert run.standalone == (nnodes == 1)
            assert nnodes == 1 or (run.rdzv_backend, run.rdzv_endpoint) == ("c10d", "$MASTER_ADDR:29500")
            args = parse_suite_args(llm_parser(), list(run.training_script_args))
        else:
            assert tokens[0] == "mindspeed-llm" and nnodes == 1  # our launcher spawns one node's ranks only
            args = parse_suite_args(llm_parser(), tokens[1:])
            assert args.nproc_per_node == nproc
        launchers.append(tokens[0])
        assert args.command == "pretrain" and args.config == str(output)
        assert f"parallel.tp={written.parallel.tp}" in args.overrides
        assert f"parallel.pp={written.parallel.pp}" in args.overrides
        assert load_pretrain_config(args.config, args.overrides) == written
    assert launchers == (["mindspeed-llm", "torchrun"] if nnodes == 1 else ["torchrun"])
