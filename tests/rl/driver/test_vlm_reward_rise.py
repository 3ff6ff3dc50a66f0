"""Vision-language GRPO learns: ``mindspeed-rl grpo --config examples/rl/grpo_vlm_tiny_cpu.yaml``.

The command as a user runs it (in a fresh working directory, where it builds the demo once: the
multimodal suite's shapes demo and the tiny Qwen2.5-VL warm-started for 40 supervised steps). The
reference is the starting policy's own measured held-out accuracy (``eval/reward_mean`` at step 0:
120 questions on pictures used by neither the warm start nor GRPO, each answered twice, sampled as
the rollout samples, seeds fixed for the run): after the 30 steps it must be higher by a margin,
and the training reward of the last steps above the first steps'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_vlm_tiny_cpu.yaml"
K = 5  # steps averaged at each end of the reward curve


@pytest.mark.slow
def test_vlm_grpo_raises_the_held_out_accuracy(tmp_path: Path, monkeypatch, capsys) -> None:
    from mindspeed_rl.cli import main

    monkeypatch.chdir(tmp_path)  # the demo's cache (runs/rl-vlm-demo) goes here
    assert main(["grpo", "--config", str(RECIPE), f"logging.dir={tmp_path / 'logs'}"]) == 0
    assert "30 steps: reward" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward_mean" in line]
    assert [line["step"] for line in steps] == list(range(1, 31))
    rewards = [line["reward_mean"] for line in steps]
    assert sum(rewards[-K:]) / K > sum(rewards[:K]) / K + 0.05, rewards
    held_out = {int(line["step"]): line["eval/reward_mean"] for line in lines if "eval/reward_mean" in line}
    assert list(held_out) == [0, 10, 20, 30], held_out
    assert held_out[30] > held_out[0] + 0.08, held_out
