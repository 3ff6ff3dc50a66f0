"""``mindspeed-rl grpo`` dispatches a vision-language recipe: one step on the tiny Qwen2.5-VL, end to end.

The tiny model and its image questions are built in code; the run writes ``metrics.jsonl`` (the
held-out evaluation as step 0, then step 1 with the update's metrics) and the summary line.
"""

from __future__ import annotations

import json
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_vlm_tiny_cpu.yaml"


def test_cli_runs_one_vision_language_step(tmp_path: Path, capsys) -> None:
    from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model
    from mindspeed_rl.cli import main

    model = write_tiny_model(tmp_path / "model")
    data = write_tiny_dataset(tmp_path / "data", num_samples=4)
    overrides = [
        f"actor.model={model}",
        f"data.path={data}",
        f"data.eval_path={data}",
        "train.steps=1",
        "train.global_batch=2",
        "train.eval_n=1",
        "rollout.n=2",
        "actor.micro_batch_size=4",
        "rollout.max_new_tokens=4",
        f"logging.dir={tmp_path / 'logs'}",
    ]
    assert main(["grpo", "--config", str(RECIPE), *overrides]) == 0
    assert "1 steps: reward" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0.0, 1.0]
    assert "eval/reward_mean" in lines[0] and "eval/reward_mean" in lines[1]
    step = lines[1]
    assert step["policy_version"] == 1.0 and step["skipped_updates"] == 0.0
    assert {"loss", "grad_norm", "reward_mean", "time/rollout", "time/update"} <= set(step)
