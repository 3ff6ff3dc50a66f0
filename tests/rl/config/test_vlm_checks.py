"""A vision-language recipe's checks: what the one-process path does not run is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed.config import ConfigError
from mindspeed_rl.config.grpo import GRPOConfig, load_grpo_config
from mindspeed_rl.config.vlm import check_vlm
from mindspeed_rl.rewards import build_verifier

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_vlm_tiny_cpu.yaml"


def _config(tmp_path: Path, *overrides: str) -> GRPOConfig:
    (tmp_path / "config.json").write_text("{}")
    return load_grpo_config(RECIPE, [f"actor.model={tmp_path}", *overrides])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor.tp=2", "actor.tp"),
        ("actor.pp=2", "actor.pp"),
        ("rollout.engine=vllm", "rollout.engine"),
        ("rollout.colocate=false", "rollout.colocate"),
        ("algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling"),
    ],
)
def test_unsupported_keys_are_named(tmp_path: Path, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: actor.model_type=vlm runs data- and sequence-parallel ranks only"):
        check_vlm(_config(tmp_path, override))


def test_the_shipped_recipe_passes_and_a_model_without_config_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.actor.model_type == "vlm"
    check_vlm(config)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_vlm(config)


def test_data_parallel_shares_must_be_whole_responses(tmp_path: Path) -> None:
    """The shipped recipe's 8 x 8 responses over actor.dp=2 (32 a rank, packed up to 64 a forward) pass;
    a mini-batch the data-parallel ranks cannot share evenly is refused (the text path's check)."""
    data = tmp_path / "q.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}\n')
    files = [f"data.path={data}", f"data.eval_path={data}"]
    config = _config(tmp_path, *files, "actor.dp=2", "actor.fsdp=true")
    config.check()
    check_vlm(config)
    with pytest.raises(ConfigError, match=r"= 24 responses does not split over actor.dp=5 ranks"):
        _config(tmp_path, *files, "actor.dp=5", "train.global_batch=3").check()


def test_exact_verifier() -> None:
    exact = build_verifier("exact")
    assert exact("q", " Red.", "red") == 1.0
    assert exact("q", "red square", "red") == 0.0
    assert exact("q", "red", None) == 0.0
    assert build_verifier("exact", case_sensitive=True)("q", "Red", "red") == 0.0


def test_ulysses_is_for_vlm_and_must_match_the_ranks(tmp_path: Path) -> None:
    from mindspeed_rl.driver.vlm_cli import run_vlm_grpo

    with pytest.raises(ConfigError, match="^actor.ulysses_parallel_size=2 is for actor.model_type=vlm"):
        _config(tmp_path, "actor.model_type=llm", "actor.ulysses_parallel_size=2").check()
    with pytest.raises(
        ValueError,
        match=r"^1 ranks and actor.dp=1 x actor.ulysses_parallel_size=2 = 2: start 2 ranks \(--nproc-per-node 2\)",
    ):
        run_vlm_grpo(_config(tmp_path, "actor.ulysses_parallel_size=2"))
    with pytest.raises(
        ValueError, match=r"^2 ranks and actor.dp=2 x actor.ulysses_parallel_size=2 = 4: .* actor.dp=1$"
    ):
        run_vlm_grpo(_config(tmp_path, "actor.dp=2", "actor.ulysses_parallel_size=2"), nproc_per_node=2)
    with pytest.raises(ConfigError, match="^actor.fsdp is for actor.model_type=vlm"):
        _config(tmp_path, "actor.model_type=llm", "actor.fsdp=true").check()


def test_launcher_flags_are_refused_for_a_text_run(tmp_path: Path, capsys) -> None:
    from mindspeed_rl.cli import main

    (tmp_path / "config.json").write_text("{}")
    args = ["grpo", "--nproc-per-node", "2", "--config", str(RECIPE), f"actor.model={tmp_path}", "actor.model_type=llm"]
    assert main(args) == 2
    assert "--nproc-per-node / --nnodes start the ranks of an actor.model_type=vlm run" in capsys.readouterr().err
