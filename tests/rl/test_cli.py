"""The ``mindspeed-rl`` entry point: installed, versioned, helpful without arguments."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from mindspeed_rl.cli import main


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mindspeed-rl {importlib.metadata.version('mindspeed-rl')}"
    assert main([]) == 0
    assert "usage: mindspeed-rl" in capsys.readouterr().out


def test_unknown_command_fails_cleanly() -> None:
    out = subprocess.run([sys.executable, "-m", "mindspeed_rl.cli", "no-such-command"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


@pytest.mark.parametrize(
    "args, names",
    [
        (["actor.model=/no/such/dir"], "actor.model"),
        (["actor.modle=x"], "actor.modle"),
        (["rollout.n=1", "actor.model=."], "rollout.n"),
        (["buffer.mode=async", "actor.model=."], "buffer.mode"),
        (["actor.lr=-1e-6", "actor.model=."], "actor.lr=-1e-06 must be positive"),
    ],
)
def test_grpo_bad_recipe_exits_2_before_any_worker(capsys, tmp_path, args: list[str], names: str) -> None:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    args = [a.replace("actor.model=.", f"actor.model={tmp_path / 'hf'}") for a in args]
    assert main(["grpo", *args, f"checkpoint.save={tmp_path / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and names in err
    assert not (tmp_path / "ckpt").exists()  # nothing written
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()  # refused before Ray started


def test_ppo_bad_recipe_exits_2_before_any_worker(capsys, tmp_path) -> None:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    args = [f"actor.model={tmp_path / 'hf'}", "critic.cliprange_value=0", f"checkpoint.save={tmp_path / 'ckpt'}"]
    assert main(["ppo", *args]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "critic.cliprange_value=0" in err
    assert not (tmp_path / "ckpt").exists()
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_grpo_overrides_are_accepted_anywhere_on_the_line() -> None:
    from mindspeed.suite_cli import parse_suite_args
    from mindspeed_rl.cli import build_parser

    args = parse_suite_args(build_parser(), ["grpo", "rollout.n=4", "--config", "r.yaml", "train.steps=2"])
    assert args.config == "r.yaml" and args.overrides == ["rollout.n=4", "train.steps=2"]


def test_grpo_print_config_prints_the_resolved_recipe_and_starts_nothing(capsys, tmp_path) -> None:
    """As ``mindspeed-llm pretrain`` / ``mindspeed-mm train --print-config``: the recipe as YAML, exit 0."""
    import yaml

    from mindspeed_rl.config.grpo import SECTIONS, load_grpo_config

    overrides = ["rollout.n=4", "train.steps=3", f"checkpoint.save={tmp_path / 'ckpt'}"]
    assert main(["grpo", "--print-config", *overrides]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert list(printed) == list(SECTIONS) and printed["rollout"]["n"] == 4 and printed["train"]["steps"] == 3
    (tmp_path / "printed.yaml").write_text(out)
    assert load_grpo_config(tmp_path / "printed.yaml") == load_grpo_config(None, overrides)  # round-trips
    assert not (tmp_path / "ckpt").exists()
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()
