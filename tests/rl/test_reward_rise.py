"""GRPO learns: the shipped CPU recipe raises the demo policy's reward on the arithmetic set.

One spawned single-rank group builds the demo starting policy, runs the steps of
``examples/rl/grpo_tiny_cpu.yaml`` with :func:`mindspeed_rl.trainer.grpo_step`, and measures the
policy before and after on the 64 held-out prompts (``demo-test``, used by neither the warm start
nor GRPO) with the rollout engine that GRPO itself syncs. The reference is the starting policy's
own measured numbers: the mean reward of the last steps must beat the first steps' by a margin,
and the held-out accuracy sampled as the rollout samples must rise. GRPO here mostly sharpens
the policy (the warm start is right greedily on ~60 % of the held-out prompts, sampled on ~25 %),
so greedy accuracy is only required not to collapse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "rl" / "grpo_tiny_cpu.yaml"
K = 5  # steps averaged at each end of the reward curve


def _run(rank: int, world_size: int, root: str, cache: str) -> dict[str, Any]:
    from mindspeed_rl.config import load_grpo_config
    from mindspeed_rl.data import load_prompts
    from mindspeed_rl.demo_model import evaluate_accuracy, resolve_model
    from mindspeed_rl.trainer import build_context, grpo_step

    model = resolve_model("demo", cache)
    config = load_grpo_config(RECIPE, [f"actor.model={model}", f"logging.dir={root}/logs"])
    ctx = build_context(config)
    held_out = load_prompts(config.data.eval_path)

    def measure() -> dict[str, float]:
        return {
            "greedy": evaluate_accuracy(ctx.engine, ctx.tokenizer, held_out),
            "sampled": evaluate_accuracy(
                ctx.engine, ctx.tokenizer, held_out, temperature=config.rollout.temperature, n=8, seed=7
            ),
        }

    before = measure()
    history = [grpo_step(ctx) for _ in range(config.train.steps)]
    return {"before": before, "after": measure(), "history": history}


@pytest.mark.slow
def test_grpo_raises_the_reward_of_the_demo_policy(tmp_path: Path, demo_policy_cache: Path) -> None:
    out = run_distributed(_run, 1, str(tmp_path), str(demo_policy_cache), timeout=1500)[0]
    rewards = [record["reward_mean"] for record in out["history"]]
    first, last = sum(rewards[:K]) / K, sum(rewards[-K:]) / K
    assert last > first + 0.1, rewards
    before, after = out["before"], out["after"]
    assert after["sampled"] > before["sampled"] + 0.05, (before, after)
    assert after["greedy"] >= before["greedy"] - 0.1, (before, after)
