"""A tiny pretrain run with every tracker on (offline): each tracker's records equal metrics.jsonl's.

Read back with each library's own reader (tests/core/metrics/readers.py): MLflow's
``get_metric_history``, W&B's offline run file, SwanLab's offline run file, TensorBoard's
``EventAccumulator``; the resolved recipe is each run's config / params.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from mindspeed.testing.distributed import run_distributed
from tests.core.metrics.readers import (
    OFFLINE_ENV,
    jsonl_series,
    mlflow_series,
    offline_overrides,
    swanlab_run,
    tensorboard_series,
    wandb_run,
)
from tests.llm.training.datasets import write_indexed_dataset


def _run(rank: int, world_size: int, prefix: str, out: str) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    os.environ.update(OFFLINE_ENV)
    config = load_pretrain_config(
        None,
        [
            f"data.prefixes=[{prefix}]",
            "data.seq_length=16",
            "data.split=9,1,0",
            "model.vocab_size=128",
            "train.steps=3",
            "train.micro_batch_size=2",
            "train.lr=1e-3",
            "eval.interval=2",
            "eval.iters=1",
            "logging.progress=false",
            "logging.mlflow.experiment=llm-pretrain",
            f"logging.dir={out}",
            *offline_overrides(Path(out)),
        ],
    )
    result = pretrain(config)
    return {"steps": [r["step"] for r in result.records], "evals": len(result.evals)}


def test_pretrain_sends_every_record_to_every_tracker(tmp_path: Path) -> None:
    prefix = write_indexed_dataset(tmp_path / "data" / "d", 60, seed=3)
    out = tmp_path / "run"
    (summary,) = run_distributed(_run, 1, prefix, str(out), timeout=600)
    assert summary == {"steps": [1, 2, 3], "evals": 1}

    expected = jsonl_series(out / "metrics.jsonl")
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss"} <= set(expected)
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3] and [s for s, _ in expected["eval/loss"]] == [2]

    board = tensorboard_series(out / "tensorboard")
    assert set(board) == set(expected)
    for key, points in expected.items():
        assert board[key] == [(s, pytest.approx(v, rel=1e-6, abs=1e-30)) for s, v in points], key

    ml, params = mlflow_series((out / "mlruns").resolve().as_uri(), "llm-pretrain", list(expected))
    assert ml == expected
    assert params["train.steps"] == "3" and params["stage"] == "pretrain" and params["logging.mlflow.experiment"]

    wb, wb_config, _ = wandb_run(out)
    assert wb == expected
    assert wb_config["train"]["steps"] == 3 and wb_config["data"]["seq_length"] == 16

    sw, sw_config, _ = swanlab_run(out / "swanlog")
    assert sw == expected
    assert yaml.safe_load(sw_config.read_text())["train"]["value"]["steps"] == 3
