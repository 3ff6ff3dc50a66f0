"""``mindspeed-rl grpo`` and logging.trackers: records, the recipe and the held-out samples reach the trackers.

The GRPO runner is replaced by a stand-in that plays two steps (the second with an evaluation),
so the CLI's wiring is checked without Ray: MLflow (a local file store) holds the same series as
``metrics.jsonl``, the resolved recipe as params and the samples as an artifact. A tracker whose
library is missing stops the command before any worker with one line naming the extra (exit 2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindspeed.metrics import config as metrics_config
from mindspeed_rl.cli import main
from tests.core.metrics.readers import OFFLINE_ENV, jsonl_series, mlflow_series

SAMPLES = [{"prompt": "1+1=", "response": "2", "reward": 1.0}]


class _Runner:
    """Stands in for :class:`mindspeed_rl.driver.runner.GRPORunner`: two steps, the second evaluated."""

    def __init__(self, config) -> None:
        self.config, self.stopped, self.failed = config, None, None
        self.ctx = SimpleNamespace(step=0, eval_samples=[])

    def run(self, on_step, preemption=None) -> list[dict]:
        records = []
        for step in (1, 2):
            self.ctx.step = step
            record = {"step": step, "reward_mean": 0.25 * step, "loss": -0.1 * step, "time/step": 1.0}
            if step == 2:
                record["eval/reward_mean"] = 0.5
                self.ctx.eval_samples = SAMPLES
            on_step(record)
            records.append(record)
        return records

    def shutdown(self) -> None:
        pass


def test_grpo_sends_records_recipe_and_samples_to_the_trackers(tmp_path, monkeypatch, capsys) -> None:
    import mindspeed_rl.driver.runner

    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(mindspeed_rl.driver.runner, "GRPORunner", _Runner)
    uri = (tmp_path / "mlruns").resolve().as_uri()
    code = main(
        [
            "grpo",
            f"logging.dir={tmp_path}",
            "logging.trackers=[jsonl, mlflow]",
            f"logging.mlflow.tracking_uri={uri}",
            "logging.mlflow.experiment=rl",
            "logging.progress=false",
            "train.steps=2",
        ]
    )
    assert code == 0, capsys.readouterr().err
    expected = jsonl_series(tmp_path / "metrics.jsonl")
    assert expected["reward_mean"] == [(1, 0.25), (2, 0.5)] and expected["eval/reward_mean"] == [(2, 0.5)]
    series, params = mlflow_series(uri, "rl", list(expected))
    assert series == expected
    assert params["train.steps"] == "2" and params["logging.trackers"] == '["jsonl", "mlflow"]'
    assert not (tmp_path / "tensorboard").exists()  # not in logging.trackers
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rl").experiment_id])
    local = client.download_artifacts(run.info.run_id, "eval/samples", str(tmp_path / "artifacts"))
    (sample_file,) = Path(local).iterdir()
    assert sample_file.name == "step_00000002.json" and json.loads(sample_file.read_text()) == SAMPLES
    assert os.environ["WANDB_MODE"] == "offline"  # the test's guard stayed in place


class _FailingRunner(_Runner):
    """Fails in the middle of step 2, after step 1 was recorded."""

    def run(self, on_step, preemption=None) -> list[dict]:
        on_step({"step": 1, "reward_mean": 0.25})
        raise RuntimeError("worker died")


def test_grpo_closes_its_trackers_when_the_run_fails(tmp_path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    import mindspeed_rl.driver.runner

    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(mindspeed_rl.driver.runner, "GRPORunner", _FailingRunner)
    uri = (tmp_path / "mlruns").resolve().as_uri()
    overrides = [f"logging.dir={tmp_path}", "logging.trackers=[jsonl, mlflow]", f"logging.mlflow.tracking_uri={uri}"]
    with pytest.raises(RuntimeError, match="worker died"):
        main(["grpo", *overrides, "logging.mlflow.experiment=rl-fail", "logging.progress=false"])
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rl-fail").experiment_id])
    assert run.info.status == "FINISHED"  # closed (set_terminated), not left RUNNING
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [0.25]


def test_grpo_with_a_tracker_whose_library_is_missing_exits_2_naming_the_extra(tmp_path, monkeypatch, capsys) -> None:
    real = metrics_config.importlib.util.find_spec
    monkeypatch.setattr(
        metrics_config.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("llama2", tmp_path / "hf", seed=0)
    args = [f"actor.model={tmp_path / 'hf'}", f"checkpoint.save={tmp_path / 'ckpt'}", "logging.trackers=[wandb]"]
    assert main(["grpo", *args]) == 2
    err = capsys.readouterr().err
    assert "pip install 'mindspeed-core[wandb]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists()


def test_grpo_unknown_tracker_exits_2_with_a_suggestion(tmp_path, capsys) -> None:
    args = [
        f"actor.model={tmp_path}",  # a directory: the recipe's first problem is the tracker's name
        "logging.trackers=[jsonl, wandbb]",
        f"checkpoint.save={tmp_path / 'ckpt'}",
    ]
    assert main(["grpo", *args]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'wandb'?" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists()
