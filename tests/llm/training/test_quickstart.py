"""The README's main job: ``mindspeed-llm quickstart`` goes from the shipped text to a model whose loss falls.

Also: the shipped recipe and its packaged copy are the same file, and it is a valid recipe.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_llm.training.checkpoint import list_checkpoints
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.metrics import read_metrics
from mindspeed_llm.training.quickstart import TINY_CPU_RECIPE
from tests.llm.training.datasets import write_indexed_dataset

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "llm" / "tiny_cpu.yaml"


def test_example_recipe_is_the_packaged_one_and_valid(tmp_path: Path) -> None:
    assert EXAMPLE.read_text() == TINY_CPU_RECIPE.read_text(), "examples/llm/tiny_cpu.yaml and the packaged copy differ"
    config = load_pretrain_config(EXAMPLE, [f"data.prefixes=[{write_indexed_dataset(tmp_path / 'd', 20, seed=0)}]"])
    assert config.data.tokenizer == "demo" and config.train.steps >= 200
    config.check(world_size=1)
    config.check(world_size=2)


@pytest.mark.slow
def test_quickstart_trains_on_the_demo_corpus_and_the_loss_falls(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    command = [str(Path(sys.executable).parent / "mindspeed-llm"), "--log-level", "WARNING", "quickstart",
               "--output-dir", str(out), "train.steps=30", "train.lr_warmup_steps=5", "eval.interval=15",
               "checkpoint.interval=null", "logging.progress=false"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    train = [r["loss"] for r in records if r["kind"] == "train"]
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(train) == 30 and len(evals) == 2
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 1.5, f"the loss did not fall: {train}"
    assert evals[1] < evals[0]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["iter_0000030"]
    assert (out / "loss.png").is_file() and (out / "data" / "demo_text_document.bin").is_file()
    # The trained model, exported for transformers (and the engine that continued the prompt).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert AutoTokenizer.from_pretrained(out / "hf")("The river")["input_ids"]
