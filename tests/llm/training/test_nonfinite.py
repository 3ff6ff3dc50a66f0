"""NaN/Inf losses: the step is skipped (no update, no schedule step) and logged; K in a row stop the run.

A loss hook turns every per-token loss into NaN at chosen steps. With one bad step the run
goes on: that step is marked skipped in the result and in ``metrics.jsonl`` (its loss written
as "nan"), the next step trains with the learning rate the skipped one would have used, and
later losses are finite, so no NaN reached the weights or the optimizer state. With bad steps
from step 2 on and ``train.max_nonfinite_steps=2`` the run stops after step 3 with a reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.metrics.log import read_metrics
from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset

#: The MFU denominator the runs are given (one device).
PEAK_TFLOPS = 0.5


def _training_flops_per_token(layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, seq: int) -> int:
    """Megatron's count, written out: 3 x forward (backward = 2 x forward); per layer the QKV and
    output projections, scores and values (4 s h), the gated MLP (three h x ffn matmuls); then the logits."""
    head_dim = hidden // heads
    layer = (
        2 * hidden * (hidden + 2 * groups * head_dim) + 2 * hidden * hidden + 4 * seq * hidden + 3 * 2 * hidden * ffn
    )
    return 3 * (layers * layer + 2 * hidden * vocab)


class _NanAt:
    def __init__(self, steps: set[int] | None = None, from_step: int | None = None) -> None:
        self.steps, self.from_step = steps or set(), from_step

    def __call__(self, step: int, losses: torch.Tensor) -> torch.Tensor:
        bad = step in self.steps or (self.from_step is not None and step >= self.from_step)
        return losses * float("nan") if bad else losses


def _runs(rank: int, world_size: int, prefix: str, out: str) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    common = [
        f"data.prefixes=[{prefix}]",
        "data.seq_length=16",
        "data.split=1",
        "model.vocab_size=128",
        "train.steps=6",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.lr=1e-3",
        "train.lr_decay_style=linear",
        "logging.progress=false",
        f"logging.peak_tflops={PEAK_TFLOPS}",
    ]
    once = pretrain(load_pretrain_config(None, [*common, f"logging.dir={out}/once"]), TrainerHooks(_NanAt({3})))
    stuck = pretrain(
        load_pretrain_config(None, [*common, f"logging.dir={out}/stuck", "train.max_nonfinite_steps=2"]),
        TrainerHooks(_NanAt(from_step=2)),
    )
    return {"once": (once.records, once.stopped, once.state), "stuck": (stuck.records, stuck.stopped, stuck.state)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("nonfinite")
    prefix = write_indexed_dataset(root / "data" / "d", 60, seed=4)
    (result,) = run_distributed(_runs, 1, prefix, str(root), timeout=600)
    return result, root


def test_one_bad_step_is_skipped_and_training_goes_on(runs: tuple[dict[str, Any], Path]) -> None:
    (records, stopped, state), root = runs[0]["once"], runs[1]
    assert stopped is None and [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    bad = records[2]
    assert math.isnan(bad["loss"]) and bad["grad_norm"] is None
    assert records[3]["lr"] == bad["lr"] < records[1]["lr"], "the schedule advanced on the skipped step"
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[3:])
    assert state["skipped_steps"] == 1 and state["nonfinite_streak"] == 0
    logged = [r for r in read_metrics(root / "once" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["loss"] for r in logged][2] == "nan" and logged[2]["skipped"] is True
    # Throughput and MFU against the step times, the batch and a FLOP count written out here: the
    # default model (2 layers, hidden 64, 4 heads, MLP 4 x hidden), vocabulary 128, 16 tokens.
    flops = _training_flops_per_token(layers=2, hidden=64, heads=4, groups=4, ffn=256, vocab=128, seq=16)
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(4 * 16 / record["step_time_s"], rel=1e-9)
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * flops / (PEAK_TFLOPS * 1e12), rel=1e-9)
    assert [r["tokens_per_s"] for r in logged] == pytest.approx([r["tokens_per_s"] for r in records])
    assert [r["mfu"] for r in logged] == pytest.approx([r["mfu"] for r in records])


def test_consecutive_bad_steps_stop_the_run(runs: tuple[dict[str, Any], Path]) -> None:
    records, stopped, state = runs[0]["stuck"]
    assert [r["step"] for r in records] == [1, 2, 3] and [r["skipped"] for r in records] == [False, True, True]
    assert "2 consecutive steps with a non-finite loss" in stopped and "step 3" in stopped
    assert state["nonfinite_streak"] == 2
