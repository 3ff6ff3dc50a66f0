"""LoRA GRPO learns: ``examples/rl/grpo_lora_tiny_cpu.yaml`` raises the demo policy's reward.

One spawned single-rank group runs the shipped recipe with
:func:`mindspeed_rl.driver.trainer.train_grpo` (40 steps: only LoRA adapters train, the KL
reference is the actor with its adapters off, the engine generates with the merged weights). The
reference is the starting policy's own measured numbers: the mean reward of the last steps must beat
the first steps' by a margin, and the held-out accuracy after the last step must beat the starting
policy's. At the end the recipe's ``actor.lora.save_peft`` writes the adapter with its rank and alpha
(that a PEFT adapter computes the actor's log-probs is tests/rl/models/test_actor_lora.py's proof).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_lora_tiny_cpu.yaml"
K = 5  # steps averaged at each end of the reward curve


def _run(rank: int, world_size: int, root: str, cache: str) -> list[dict[str, Any]]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.demo.model import resolve_model
    from mindspeed_rl.driver.trainer import train_grpo

    model = resolve_model("demo", cache)
    config = load_grpo_config(
        RECIPE, [f"actor.model={model}", f"logging.dir={root}/logs", f"actor.lora.save_peft={root}/peft"]
    )
    train_grpo(config)
    return [json.loads(line) for line in (Path(root) / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lora_grpo_raises_the_reward_of_the_demo_policy(tmp_path: Path, demo_policy_cache: Path) -> None:
    lines = run_distributed(_run, 1, str(tmp_path), str(demo_policy_cache), timeout=1500)[0]
    steps = [line for line in lines if "reward_mean" in line]
    assert [line["step"] for line in steps] == list(range(1, 41))
    rewards = [line["reward_mean"] for line in steps]
    first, last = sum(rewards[:K]) / K, sum(rewards[-K:]) / K
    assert last > first + 0.1, rewards
    held_out = {int(line["step"]): line["eval/reward_mean"] for line in lines if "eval/reward_mean" in line}
    assert list(held_out) == [0, 10, 20, 30, 40], held_out
    assert held_out[40] > held_out[0] + 0.05, held_out
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
