"""Multi-turn rollouts on Ray: the agent loop in the rollout workers (overlapped) = the driver's loop (barrier).

One local Ray instance, the automaton Llama of tests/rl/rollout/test_agent_overlap.py saved as a
Hugging Face directory (it writes filler dots, then a calculator call on a sampled digit or the
answer ``A``), a format reward on the answer (so the rewards vary). ``mindspeed-rl grpo``'s runner,
two steps each:

- ``rollout.tool_overlap=false``: the driver runs the loop and the tools, the co-located workers
  generate one turn at a time (the barrier);
- ``tool_overlap=true``, co-located: each actor worker runs the driver's ``AgentLoop`` on its share
  with its own engine (overlapped) and the tools; and the same with a separate rollout pool.

The workers' runs went through ``agent_generate`` (counted on the driver) and their steps equal the
barrier's: the rewards, response lengths, tool metrics exactly (the same samples), the losses and
gradient norms to 1e-6. Then ``mindspeed-rl ppo`` with the same tools for two steps (the loss mask
through the co-located critic's workers): the critic's loss and gradient norm are finite and it learns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

EXACT = ("reward_mean", "reward_std", "response_length", "tools/calls", "tools/turns", "tools/call_rate")
CLOSE = ("loss", "grad_norm")


def _recipe(root: Path, *extra: str) -> list[str]:
    return [
        f"actor.model={root}/hf",
        "actor.lr=1e-3",
        "actor.micro_batch_size=4",
        f"data.path={root}/prompts.jsonl",
        "data.prompt_format=chat",
        "rollout.n=4",
        "rollout.max_new_tokens=24",
        "rollout.max_prompt_length=1024",
        "rollout.tools=[calculator]",
        "rollout.max_turns=3",
        "rollout.max_response_length=300",
        "reward.verifiers=[format]",
        "reward.options={format: {pattern: '^A$', fullmatch: true}}",
        "train.global_batch=2",
        "train.steps=2",
        "algorithm.kl_coef=0",
        "logging.progress=false",
        *extra,
    ]


def test_the_loop_in_the_workers_equals_the_drivers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mindspeed_rl.cli import main
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.ray_runtime import init_ray
    from mindspeed_rl.driver.runner import GRPORunner
    from mindspeed_rl.workers import group
    from tests.rl.rollout.test_agent_overlap import save_automaton

    save_automaton(tmp_path / "hf")
    lines = "".join(f'{{"question": "What is {a} * 7?", "answer": "#### {a * 7}"}}\n' for a in range(10, 20))
    (tmp_path / "prompts.jsonl").write_text(lines)
    calls: list[str] = []
    for cls in (group.ColocatedRollout, group.RolloutPool):
        original = cls.agent_generate

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = cls.__name__) -> Any:
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(cls, "agent_generate", counted)

    ray = init_ray(num_cpus=4)
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for name, extra in (
            ("barrier", ["rollout.tool_overlap=false"]),
            ("colocated", []),
            ("pool", ["rollout.colocate=false", "rollout.num_devices=1"]),
        ):
            runner = GRPORunner(load_grpo_config(None, _recipe(tmp_path, *extra)))
            try:
                runs[name] = runner.run()
            finally:
                runner.shutdown()
        # mindspeed-rl ppo with tools: the loss mask reaches the co-located critic through the workers.
        ppo = _recipe(tmp_path, "critic.lr=1e-3", f"logging.dir={tmp_path}/ppo")
        assert main(["ppo", *[o for o in ppo if not o.startswith("algorithm.kl_coef")]]) == 0
    finally:
        ray.shutdown()
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2 and all(r["tools/calls"] > 0 for r in steps), steps
    for r in steps:
        assert r["critic/vf_loss"] > 0 and math.isfinite(r["critic/grad_norm"]) and math.isfinite(r["loss"]), r
    assert calls == ["ColocatedRollout"] * 2 + ["RolloutPool"] * 2 + ["ColocatedRollout"] * 2, calls  # grpo x2, ppo
    barrier = runs["barrier"]
    assert sum(r["tools/calls"] for r in barrier) > 0 and 0 < barrier[0]["reward_mean"] < 1, barrier
    for name in ("colocated", "pool"):
        assert len(runs[name]) == len(barrier) == 2
        for got, want in zip(runs[name], barrier):
            for key in EXACT:
                assert got[key] == want[key], (name, key, got[key], want[key])
            for key in CLOSE:
                assert math.isclose(got[key], want[key], rel_tol=1e-6, abs_tol=1e-9), (name, key, got[key], want[key])
            assert got["rollout_logp_diff"] < 1e-5
