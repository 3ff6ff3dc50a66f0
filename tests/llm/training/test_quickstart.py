"""The README's main job: ``mindspeed-llm quickstart`` goes from the shipped text to a model whose loss falls.

Also: the shipped recipe and its packaged copy are the same file, and it is a valid recipe.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed.metrics.log import read_metrics
from mindspeed_llm.training.checkpoint import list_checkpoints
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.quickstart import TINY_CPU_RECIPE
from tests.golden import DEFAULT_THREADS, check_golden
from tests.llm.training.datasets import write_indexed_dataset

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "llm" / "tiny_cpu.yaml"


def test_example_recipe_is_the_packaged_one_and_valid(tmp_path: Path) -> None:
    assert EXAMPLE.read_text() == TINY_CPU_RECIPE.read_text(), "examples/llm/tiny_cpu.yaml and the packaged copy differ"
    config = load_pretrain_config(EXAMPLE, [f"data.prefixes=[{write_indexed_dataset(tmp_path / 'd', 20, seed=0)}]"])
    assert config.data.tokenizer == "demo" and config.train.steps >= 200
    config.check(world_size=1)
    config.check(world_size=2)


def _quickstart(out: Path, *args: str) -> tuple[list[str], int]:
    command = [str(Path(sys.executable).parent / "mindspeed-llm"), "quickstart", "--output-dir", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return (done.stdout + done.stderr).splitlines(), done.returncode


#: What the console leaves to report.txt (and --verbose): the patch list, the features table and
#: its changes, kernel choices, other libraries' warnings.
DETAIL = (
    "  - cuda-api:current_device",
    "features at optimization level 2 on cpu: 6 enabled",
    "[feature] ",
    "mindspeed.ops.registry: kernel ",
    "py.warnings",
    "Warning:",
    "torch.utils.cpp_extension",
)


@pytest.mark.slow
def test_quickstart_trains_on_the_demo_corpus_and_the_loss_falls(tmp_path: Path) -> None:
    """Also: the console is the loss lines (the detail is in report.txt), and a second run says what it did
    with train.steps: below the saved step nothing is trained (one line, exit 0); above, the run goes on."""
    out = tmp_path / "qs"
    console, _ = _quickstart(
        out,
        "train.steps=30",
        "train.lr_warmup_steps=5",
        "eval.interval=15",
        "checkpoint.interval=null",
        "logging.progress=false",
        "logging.interval=10",
    )
    records = read_metrics(out / "metrics.jsonl")
    train = [r["loss"] for r in records if r["kind"] == "train"]
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(train) == 30 and len(evals) == 2
    check_golden("llm_quickstart", {"loss": train[:10]}, threads=DEFAULT_THREADS)  # the command's own threads
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 1.5, f"the loss did not fall: {train}"
    assert evals[1] < evals[0]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["iter_0000030"]
    assert (out / "loss.png").is_file() and (out / "data" / "demo_text_document.bin").is_file()
    # The console: the loss lines, not the detail; the run's report.txt has the detail.
    for step in (10, 20, 30):
        assert any(f"step {step}/30: loss {train[step - 1]:.4f}" in line for line in console), console
    assert not [line for line in console if any(d in line for d in DETAIL)], console
    assert len(console) <= 25, console  # 99 lines on stderr before the quiet console
    report = (out / "report.txt").read_text()
    assert all(d in report for d in DETAIL[:4]), report[:3000]
    # Other libraries' warnings: each one at most once (here, in report.txt only).
    warned = [line.split(" py.warnings: ", 1)[1] for line in report.splitlines() if " py.warnings: " in line]
    assert len(warned) == len(set(warned))
    # The trained model, exported for transformers (and the engine that continued the prompt).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert AutoTokenizer.from_pretrained(out / "hf")("The river")["input_ids"]

    # Again with fewer steps: nothing is trained, and the line says so (the README's quickstart train.steps=100).
    console, _ = _quickstart(out, "train.steps=20", "train.lr_warmup_steps=5")
    assert any(
        f"{out / 'checkpoints'} already holds step 30, at or past train.steps=20: nothing to train" in line
        for line in console
    ), console
    assert len(read_metrics(out / "metrics.jsonl")) == len(records)
    # More steps: the run resumes and goes on; --verbose (anywhere on the line) shows the detail.
    console, _ = _quickstart(out, "train.steps=32", "train.lr_warmup_steps=5", "logging.interval=1", "--verbose")
    assert any(
        f"resumed the run in {out / 'checkpoints'} at step 30 and trained on to train.steps=32" in line
        for line in console
    ), console
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"][-3:] == [30, 31, 32]
    assert all(any(d in line for line in console) for d in DETAIL[:4])
