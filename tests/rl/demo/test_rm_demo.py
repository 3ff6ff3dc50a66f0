"""The reward-model demo learns: ``examples/llm/rm_tiny_cpu.yaml`` tells right sums from wrong on new questions.

``mindspeed-llm rm`` runs the shipped recipe as its header says, started from the RL demo policy
(the session's shared build, a tiny Llama that knows some sums) on the synthetic pairs of
:func:`mindspeed_llm.data.arithmetic_pairs.write_arithmetic_pairs`: 1144 training pairs, then
100 pairs on questions the training never saw, which the recipe's split makes the validation
set, each evaluated once per evaluation. The held-out pairwise accuracy after the last step must
reach 0.9 and beat the first evaluation's; the export loads as a sequence classifier.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed.metrics.log import read_metrics

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "llm" / "rm_tiny_cpu.yaml"


@pytest.mark.slow
@pytest.mark.skip(
    reason="issue 26 item 5b: the recipe reaches 0.59 held-out accuracy (steps 100-200), not 0.9 yet "
    "(docs/llm/reward-model.md, Demo); unskip when it does"
)
def test_reward_model_demo_scores_right_sums_above_wrong(tmp_path: Path, demo_policy_cache: Path) -> None:
    from mindspeed_llm.data.arithmetic_pairs import write_arithmetic_pairs
    from mindspeed_rl.demo.model import resolve_model

    policy = resolve_model("demo", demo_policy_cache)
    pairs, n_train, n_test = write_arithmetic_pairs(tmp_path / "data" / "arith_pairs.jsonl")
    assert f'split: "{n_train},{n_test},0"' in RECIPE.read_text()
    command = [
        str(Path(sys.executable).parent / "mindspeed-llm"),
        "rm",
        "--config",
        str(RECIPE),
        f"checkpoint.load_hf={policy}",
        f"data.input={pairs}",
        f"checkpoint.save_hf={tmp_path / 'rm'}",
        f"logging.dir={tmp_path / 'run'}",
        "logging.progress=false",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    accuracy = {r["step"]: r["accuracy"] for r in evals}
    assert accuracy[max(accuracy)] >= 0.9, accuracy
    assert accuracy[max(accuracy)] > accuracy[min(accuracy)], accuracy
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", output_loading_info=True)
    assert model.config.num_labels == 1 and not info["missing_keys"] and not info["unexpected_keys"]
