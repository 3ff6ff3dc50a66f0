"""Flow-GRPO learns the shapes task (issue 31, item 4): the shipped recipe, from the demo's SFT checkpoint.

``examples/mm/t2i_tiny_cpu.yaml`` trains the SFT checkpoint (300 steps); ``examples/rl/flow_grpo_t2i_tiny_cpu.yaml``
then runs Flow-GRPO on it as shipped (100 rounds; the checker's reward ``shapes``, the SDE window on the first two
steps, the same noise for a caption's 8 samples; only the check of the training captions is left out). The held-out check samples the 8 held-out
captions (never trained on, by SFT or RL) x 32 seeds by the ODE from the same noises before and after, so the
changes are paired sample by sample: the reward (the mean of the colour and position checks) and the colour
accuracy must rise by more than 3 of their paired standard errors (measured with 3 seeds: 4.3-5.6 SE and 5.0-6.3 SE,
docs/mm/dit-rl.md), and the position accuracy must not fall by more than one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_rl.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "flow_grpo_t2i_tiny_cpu.yaml"


@pytest.mark.slow
def test_flow_grpo_raises_the_held_out_accuracy_over_the_sft_checkpoint(t2i_sft_run: Path, tmp_path: Path) -> None:
    """``t2i_sft_run`` (tests/conftest.py): the SFT recipe as shipped."""
    out = tmp_path / "rl"
    overrides = [f"load_dir={t2i_sft_run / 'hf'}", "eval_train_seeds=0"]
    assert main(["flow-grpo", "--config", str(RECIPE), "--output-dir", str(out), *overrides]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start, end = records[0], records[-1]
    assert (start["eval"], end["eval"], end["iteration"]) == ("start", "end", 100)
    print({k: round(v, 4) for k, v in end.items() if k.endswith(("_gain", "_gain_se"))})
    for key in ("reward", "colour"):
        assert end[f"{key}_gain"] > 3 * end[f"{key}_gain_se"], (key, end[f"{key}_gain"], end[f"{key}_gain_se"])
    assert end["position_gain"] > -end["position_gain_se"]  # the other half does not fall
