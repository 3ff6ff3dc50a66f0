"""GRPO learns: the shipped CPU recipe raises the demo policy's reward and held-out accuracy.

One spawned single-rank group builds the demo starting policy and runs
``examples/rl/grpo_tiny_cpu.yaml`` as it ships with :func:`mindspeed_rl.driver.trainer.train_grpo`,
which writes ``metrics.jsonl`` as the command does: the held-out evaluation of the 64
``demo-test`` prompts (used by neither the warm start nor GRPO; 8 samples per prompt, sampled as
the rollout samples, seeds fixed for the run) before the first step (step 0), every 10 steps and
after the last. The reference is the starting policy's own measured numbers, read from the
metrics: the mean reward of the last steps must beat the first steps' by a margin, and the
held-out accuracy after the last step must beat the starting policy's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.golden import check_golden

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_tiny_cpu.yaml"
K = 5  # steps averaged at each end of the reward curve


def _run(rank: int, world_size: int, root: str, cache: str) -> list[dict[str, Any]]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.demo.model import resolve_model
    from mindspeed_rl.driver.trainer import train_grpo

    model = resolve_model("demo", cache)
    config = load_grpo_config(RECIPE, [f"actor.model={model}", f"logging.dir={root}/logs"])
    train_grpo(config)
    return [json.loads(line) for line in (Path(root) / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_raises_the_reward_of_the_demo_policy(tmp_path: Path, demo_policy_cache: Path) -> None:
    lines = run_distributed(_run, 1, str(tmp_path), str(demo_policy_cache), timeout=1500)[0]
    steps = [line for line in lines if "reward_mean" in line]
    assert [line["step"] for line in steps] == list(range(1, 61))
    rewards = [line["reward_mean"] for line in steps]
    check_golden(
        "rl_grpo_demo", {k: [line[k] for line in steps[:5]] for k in ("loss", "reward_mean")}, threads=1, chaotic=True
    )
    first, last = sum(rewards[:K]) / K, sum(rewards[-K:]) / K
    assert last > first + 0.1, rewards
    held_out = {int(line["step"]): line["eval/reward_mean"] for line in lines if "eval/reward_mean" in line}
    assert list(held_out) == [0, 10, 20, 30, 40, 50, 60], held_out  # start, every 10 steps, the end
    assert held_out[60] > held_out[0] + 0.05, held_out
