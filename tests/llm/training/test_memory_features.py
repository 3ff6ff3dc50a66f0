"""The memory features in ``mindspeed-llm pretrain``: same numbers, checkpoints that move between them.

Three real ``pretrain --nproc-per-node 2`` processes (DP2, bf16, the distributed optimizer, 4
steps, a checkpoint every 2):

1. no memory feature;
2. ``reuse_fp32_param`` with activation and norm recompute, stopped after step 2 (its
   checkpoint is written with the masters rebuilt from bf16 + remainders);
3. the same directory resumed to step 4 with ``swap_optimizer`` and ``swap_attention`` instead
   (the masters and Adam moments load into tensors that then move to the host).

Every logged record of steps 1-4 (loss, learning rate, gradient norm) equals run 1's exactly:
the trainer's hooks apply the features, they change no number, and the optimizer checkpoint is
megatron's own whichever feature wrote or reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed.metrics.log import read_metrics
from tests.llm.training.datasets import write_indexed_dataset

TIMING = {"step_time_s", "tokens_per_s", "mfu"}
REUSE = [
    "features.settings.reuse_fp32_param.enabled=true",
    "features.settings.recompute_activation_function.enabled=true",
    "features.settings.recompute_norm.enabled=true",
]
SWAP = [
    "features.settings.swap_optimizer.enabled=true",
    "features.settings.swap_optimizer.swap_optimizer_times=4",
    "features.settings.swap_attention.enabled=true",
]


def _command(prefix: str, out: Path, steps: int, features: list[str]) -> list[str]:
    # The default log level: the run log (report.txt) lists the features that were on.
    return [
        str(Path(sys.executable).parent / "mindspeed-llm"),
        "pretrain",
        "--nproc-per-node",
        "2",
        f"data.prefixes=[{prefix}]",
        "data.seq_length=32",
        "data.split=100,0,0",
        "model.vocab_size=128",
        "model.num_layers=2",
        "model.num_query_groups=2",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.lr=3e-3",
        "train.lr_decay_steps=4",
        "train.precision=bf16",
        "parallel.distributed_optimizer=true",
        f"checkpoint.save={out}",
        "checkpoint.interval=2",
        "logging.progress=false",
        *features,
    ]


def _numerics(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records if r["kind"] == "train"]


@pytest.mark.distributed
@pytest.mark.slow
def test_memory_features_train_and_resume_like_the_run_without_them(tmp_path: Path) -> None:
    prefix = write_indexed_dataset(tmp_path / "data" / "d", 200, seed=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain, featured = tmp_path / "plain", tmp_path / "featured"
    reports = []
    for out, steps, features in ((plain, 4, []), (featured, 2, REUSE), (featured, 4, SWAP)):
        done = subprocess.run(
            _command(prefix, out, steps, features), env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        reports.append(next(out.rglob("report.txt")).read_text())
    expected, got = (
        _numerics(read_metrics(plain / "metrics.jsonl")),
        _numerics(read_metrics(featured / "metrics.jsonl")),
    )
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert got == expected
    assert expected[-1]["loss"] < expected[0]["loss"]
    # The features were on in runs 2 and 3 (their hooks' changes are in the run log), not in run 1.
    assert "reuse_fp32_param" in reports[1] and "recompute_norm" in reports[1], reports[1][-2000:]
    assert "swap_optimizer" in reports[2] and "swap_attention" in reports[2]
    assert "hooks.post_optimizer_build" not in reports[0]
