"""NaN/Inf losses and gradient norms: the step is skipped (no update, no schedule step) and logged; K in a row stop the run.

A loss hook turns every per-token loss into NaN at chosen steps. With one bad step the run
goes on: that step is marked skipped in the result and in ``metrics.jsonl`` (its loss written
as "nan"), the next step trains with the learning rate the skipped one would have used, and
later losses are finite, so no NaN reached the weights or the optimizer state. With bad steps
from step 2 on and ``train.max_nonfinite_steps=2`` the run stops after step 3 with a reason.

A finite loss with a NaN gradient (the ``train.grad_nan`` fault point: rank 0's gradient after
the data-parallel reduction, so only rank 0 sees it) on 2 ranks, with and without the
distributed optimizer: both ranks skip the step (they agree by an all-reduce), the step-3
checkpoint's weights and Adam moments equal step 2's bit for bit, its schedule did not advance,
and the two replicas' final weights are equal.
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
    assert math.isnan(bad["loss"]) and math.isnan(bad["grad_norm"])
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


def _grad_nan_runs(rank: int, world_size: int, prefix: str, out: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    results: dict[str, Any] = {}
    for name, extra in (("ddp", []), ("distopt", ["parallel.distributed_optimizer=true"])):
        final: list[dict[str, list]] = []

        def keep(chunks: list[Any], final: list = final) -> None:
            # Plain lists: tensors through the result queue would be shared-memory handles of a rank that exits.
            state = chunks[0].module.state_dict().items()
            final.append({k: v.tolist() for k, v in state if isinstance(v, torch.Tensor) and v.is_floating_point()})

        config = load_pretrain_config(
            None,
            [
                f"data.prefixes=[{prefix}]",
                "data.seq_length=16",
                "data.split=1",
                "model.vocab_size=128",
                "model.num_layers=1",
                "model.hidden_size=16",
                "model.num_attention_heads=4",
                "model.num_query_groups=2",
                "train.steps=4",
                "train.micro_batch_size=1",
                "train.global_batch_size=2",
                "train.lr=3e-3",
                "eval.interval=null",
                "eval.at_end=false",
                f"checkpoint.save={out}/{name}",
                "checkpoint.interval=1",
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.loss_curve=false",
                *extra,
            ],
        )
        result = pretrain(config, TrainerHooks(after_train=keep))
        schedulers = [
            dist_checkpointing.load_common_state_dict(f"{out}/{name}/iter_{step:07d}")["opt_param_scheduler"][
                "num_steps"
            ]
            for step in (2, 3, 4)
        ]
        results[name] = (result.records, result.state, schedulers, final[0])
    return results


@pytest.fixture(scope="module")
def grad_nan_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("grad-nan")
    prefix = write_indexed_dataset(root / "data" / "d", 40, seed=5)
    env = {"MINDSPEED_FAULT": "train.grad_nan@3"}
    return run_distributed(_grad_nan_runs, 2, prefix, str(root), timeout=600, env=env), root


def _checkpoint_tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, file)
    state = torch.load(file, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


@pytest.mark.parametrize("name", ["ddp", "distopt"])
def test_a_nan_gradient_with_a_finite_loss_is_skipped_on_every_rank(
    grad_nan_runs: tuple[list[dict[str, Any]], Path], name: str, tmp_path: Path
) -> None:
    ranks, root = grad_nan_runs
    (records, state, schedulers, weights), (records1, _, _, weights1) = ranks[0][name], ranks[1][name]
    assert [r["skipped"] for r in records] == [False, False, True, False] == [r["skipped"] for r in records1]
    bad = records[2]
    assert math.isfinite(bad["loss"]) and math.isnan(bad["grad_norm"]), bad
    assert all(math.isfinite(r["grad_norm"]) for r in records if not r["skipped"])
    assert records[3]["lr"] == bad["lr"] < records[1]["lr"], "the schedule advanced on the skipped step"
    assert schedulers == [2, 2, 3], "the scheduler stepped on the skipped step"
    assert state["skipped_steps"] == 1 and state["nonfinite_streak"] == 0
    assert [r["skipped_steps"] for r in read_metrics(root / name / "metrics.jsonl")] == [0, 0, 1, 1]
    before, after = (_checkpoint_tensors(root / name / f"iter_{s:07d}", tmp_path) for s in (2, 3))
    assert set(before) == set(after) and any(k.startswith("optimizer.state.exp_avg") for k in before)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"the skipped step changed {changed[:4]}"
    assert weights.keys() == weights1.keys()
    assert weights == weights1, "the replicas disagree"
