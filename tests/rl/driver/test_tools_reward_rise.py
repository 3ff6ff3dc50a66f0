"""GRPO with a calculator learns to use it: the tools recipe raises the call rate and the held-out accuracy.

One spawned single-rank group builds the tools demo policy (``actor.model: demo-tools``, the
warm start of :mod:`mindspeed_rl.demo.tools_model`) and runs ``examples/rl/grpo_tools_tiny_cpu.yaml``
as it ships with :func:`mindspeed_rl.driver.trainer.train_grpo` (multi-turn rollouts through the
agent loop, the calculator's results appended with no loss). The references are the starting
policy's own measured numbers, read from ``metrics.jsonl``: the held-out evaluation (the 64
``demo-products-test`` products, used by neither the warm start nor GRPO; greedy) before the first
step (step 0) and after the last, and the sampled rollouts' reward and call rate of the first and
last steps. Measured (docs/rl/tools.md): held-out accuracy 0.000 -> 0.859 and call rate 0.00 ->
1.00; rollout reward 0.45 -> 0.79 and call rate 0.53 -> 0.96 (means of the first and last 5 steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_tools_tiny_cpu.yaml"
K = 5  # steps averaged at each end of the curves


def _run(rank: int, world_size: int, root: str) -> list[dict[str, Any]]:
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.demo.model import resolve_model
    from mindspeed_rl.demo.tools_model import TOOLS_DEMO_MODEL
    from mindspeed_rl.driver.trainer import train_grpo

    model = resolve_model(TOOLS_DEMO_MODEL, f"{root}/cache")
    config = load_grpo_config(RECIPE, [f"actor.model={model}", f"logging.dir={root}/logs"])
    train_grpo(config)
    return [json.loads(line) for line in (Path(root) / "logs" / "metrics.jsonl").read_text().splitlines()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_grpo_raises_the_tool_call_rate_and_the_held_out_accuracy(tmp_path: Path) -> None:
    lines = run_distributed(_run, 1, str(tmp_path), timeout=1500)[0]
    steps = [line for line in lines if "reward_mean" in line]
    assert [line["step"] for line in steps] == list(range(1, 21))
    held_out = {int(line["step"]): line for line in lines if "eval/reward_mean" in line}
    assert list(held_out) == [0, 5, 10, 15, 20], list(held_out)
    start, end = held_out[0], held_out[20]
    # The start does not solve the task: greedily it answers directly (and wrongly) ...
    assert start["eval/reward_mean"] < 0.2 and start["eval/tools/call_rate"] < 0.3, start
    # ... sampled, it calls the calculator on some of its samples, not on most.
    assert 0.1 < steps[0]["tools/call_rate"] < 0.6, steps[0]
    assert end["eval/tools/call_rate"] > start["eval/tools/call_rate"] + 0.5, (start, end)
    assert end["eval/reward_mean"] > start["eval/reward_mean"] + 0.5, (start, end)
    assert end["eval/tools/errors"] < 0.1, end  # its calls are well-formed
    for key, margin in (("reward_mean", 0.15), ("tools/call_rate", 0.2)):
        first, last = _mean([s[key] for s in steps[:K]]), _mean([s[key] for s in steps[-K:]])
        assert last > first + margin, (key, [s[key] for s in steps])
