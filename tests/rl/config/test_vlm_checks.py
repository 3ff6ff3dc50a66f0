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
        ("actor.dp=2", "actor.dp"),
        ("rollout.engine=vllm", "rollout.engine"),
        ("rollout.colocate=false", "rollout.colocate"),
        ("algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling"),
    ],
)
def test_unsupported_keys_are_named(tmp_path: Path, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: actor.model_type=vlm runs in one process"):
        check_vlm(_config(tmp_path, override))


def test_the_shipped_recipe_passes_and_a_model_without_config_is_refused(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.actor.model_type == "vlm"
    check_vlm(config)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        check_vlm(config)


def test_exact_verifier() -> None:
    exact = build_verifier("exact")
    assert exact("q", " Red.", "red") == 1.0
    assert exact("q", "red square", "red") == 0.0
    assert exact("q", "red", None) == 0.0
    assert build_verifier("exact", case_sensitive=True)("q", "Red", "red") == 0.0
