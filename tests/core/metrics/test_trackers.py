"""logging.trackers: every tracker's own records, read back with its own reader, equal metrics.jsonl's.

The real libraries, offline: MLflow's file store through ``MlflowClient().get_metric_history``,
W&B's offline ``.wandb`` file through W&B's protobuf records, SwanLab's offline run file through
its ``DataStoreReader``, TensorBoard through its ``EventAccumulator``. Also: the resolved recipe is
each run's config, validation samples become a table or text, a tracker that fails is dropped with
one warning while the run goes on, and the ``logging`` section's checks.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from mindspeed.config import ConfigError, from_dict
from mindspeed.metrics import config as metrics_config
from mindspeed.metrics.config import LoggingConfig
from mindspeed.metrics.log import read_metrics
from mindspeed.metrics.trackers import Tracking, open_tracking, scalars
from tests.core.metrics.readers import (
    OFFLINE_ENV,
    NoNetwork,
    jsonl_series,
    mlflow_series,
    offline_overrides,
    swanlab_run,
    tensorboard_series,
    wandb_run,
)

RECIPE = {"train": {"lr": 0.001, "steps": 4}, "model": {"name": "tiny", "layers": [1, 2]}}
SAMPLES = [{"prompt": "1+1=", "response": "2", "reward": 1.0}, {"prompt": "2|3\n", "response": "5", "reward": 0.0}]


def _records() -> list[dict]:
    out = []
    for step in range(1, 5):
        out.append({"kind": "train", "step": step, "loss": 3.0 / step, "lr": 1e-3 * step, "skipped": step == 3})
        if step == 3:
            out[-1]["loss"] = float("nan")  # a skipped step: in the JSONL as "nan", left out elsewhere
        if step % 2 == 0:
            out.append({"kind": "eval", "step": step, "loss": 2.5 / step, "perplexity": 10.0 / step})
    return out


def _settings(log_dir: Path) -> LoggingConfig:
    overrides = dict(o.split("=", 1) for o in offline_overrides(log_dir))
    return from_dict(
        LoggingConfig,
        {
            "trackers": yaml.safe_load(overrides["logging.trackers"]),
            "wandb": {"mode": "offline"},
            "swanlab": {"mode": "offline"},
            "mlflow": {"tracking_uri": overrides["logging.mlflow.tracking_uri"], "experiment": "core-test"},
        },
    )


def test_every_tracker_reads_back_metrics_jsonl_series(tmp_path, monkeypatch) -> None:
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    settings = _settings(tmp_path)
    settings.check()
    with NoNetwork() as guard:
        tracking = open_tracking(settings, tmp_path, 0, enabled=True, config=RECIPE)
        assert tracking.names == ["jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]
        for record in _records():
            tracking.write(record)
        tracking.log_samples(4, SAMPLES, name="eval/samples")
        tracking.close()
    assert not guard.attempts, f"a tracker tried the network: {guard.attempts}"

    expected = jsonl_series(tmp_path / "metrics.jsonl")
    assert set(expected) == {"train/loss", "train/lr", "eval/loss", "eval/perplexity"}
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 4]  # the NaN of step 3 is JSONL-only
    assert read_metrics(tmp_path / "metrics.jsonl")[3]["loss"] == "nan"

    board = tensorboard_series(tmp_path / "tensorboard")
    assert set(board) == set(expected)
    for key, points in expected.items():  # TensorBoard keeps float32
        assert board[key] == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], key

    ml, params = mlflow_series((tmp_path / "mlruns").resolve().as_uri(), "core-test", list(expected))
    assert ml == expected
    assert params["train.lr"] == "0.001" and params["model.name"] == "tiny" and params["model.layers"] == "[1, 2]"

    wb, wb_config, tables = wandb_run(tmp_path)
    assert wb == expected
    assert wb_config["train"] == RECIPE["train"] and wb_config["model"] == RECIPE["model"]
    (table,) = tables
    data = yaml.safe_load(table.read_text())
    assert data["columns"] == ["prompt", "response", "reward"] and data["data"][1] == ["2|3\n", "5", 0.0]

    sw, sw_config, media = swanlab_run(tmp_path / "swanlog")
    assert sw == expected
    assert yaml.safe_load(sw_config.read_text())["train"]["value"] == RECIPE["train"]
    assert [(m.key, m.step, len(m.value.items)) for m in media] == [("eval/samples", 4, 2)]


def test_scalars_name_by_kind_and_skip_flags_text_and_non_finite() -> None:
    record = {"kind": "train", "step": 2, "loss": 1.5, "tokens": 64, "skipped": False, "note": "x", "gn": float("inf")}
    assert scalars(record) == {"train/loss": 1.5, "train/tokens": 64.0}
    assert scalars({"step": 1, "reward/acc": 0.5, "time/step": 2}) == {"reward/acc": 0.5, "time/step": 2.0}


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls, self.closed = 0, 0

    def log_scalars(self, numbers, step) -> None:
        self.calls += 1
        raise ConnectionError("server went away")

    def close(self) -> None:
        self.closed += 1


def test_a_failing_tracker_warns_once_and_is_dropped_while_the_run_goes_on(tmp_path, caplog) -> None:
    tracking = open_tracking(LoggingConfig(tensorboard=False), tmp_path, 0, enabled=True)
    broken = _Broken()
    tracking.trackers.append(broken)
    with caplog.at_level(logging.WARNING, logger="mindspeed.metrics.trackers"):
        for record in _records():
            tracking.write(record)
        tracking.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "tracker broken failed (ConnectionError: server went away)" in warnings[0]
    assert broken.calls == 1 and broken.closed == 1
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == len(_records())  # the JSONL has every record


def test_other_ranks_and_no_log_dir_record_nothing(tmp_path) -> None:
    quiet = open_tracking(LoggingConfig(), tmp_path, 0, enabled=False, config=RECIPE)
    quiet.write({"kind": "train", "step": 1, "loss": 1.0})
    quiet.close()
    assert quiet.names == [] and not any(tmp_path.iterdir())
    assert open_tracking(LoggingConfig(), None, 0, enabled=True).names == []


def test_logging_section_checks(monkeypatch) -> None:
    assert LoggingConfig().resolved_trackers() == ("jsonl", "tensorboard")
    assert LoggingConfig(tensorboard=False).resolved_trackers() == ("jsonl",)  # the older switch still works
    assert LoggingConfig(trackers=["mlflow"]).resolved_trackers() == ("mlflow",)
    cases = {
        "unknown tracker 'wandbb'; did you mean 'wandb'?": {"trackers": ["wandbb"]},
        "names a tracker twice": {"trackers": ["jsonl", "jsonl"]},
        "logging.tensorboard=false but logging.trackers lists tensorboard": {
            "tensorboard": False,
            "trackers": ["tensorboard"],
        },
        "logging.wandb.mode='offlin' is not one of online, offline, disabled": {"wandb": {"mode": "offlin"}},
        "logging.interval=0 must be at least 1": {"interval": 0},
    }
    for message, values in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_dict(LoggingConfig, values).check()
    real = metrics_config.importlib.util.find_spec
    monkeypatch.setattr(
        metrics_config.importlib.util, "find_spec", lambda name: None if name == "swanlab" else real(name)
    )
    with pytest.raises(ConfigError) as err:
        LoggingConfig(trackers=["jsonl", "swanlab"]).check()
    assert str(err.value) == (
        "logging.trackers lists swanlab but its library is not installed: "
        "pip install 'mindspeed-core[swanlab]' (or remove swanlab from logging.trackers)"
    )
    with pytest.raises(
        ConfigError, match="unknown config key 'logging.wandb.projekt'.*did you mean 'logging.wandb.project'"
    ):
        from_dict(LoggingConfig, {"wandb": {"projekt": "x"}}, "logging.")


def test_tracking_is_a_context_manager_and_closes_twice_safely(tmp_path) -> None:
    with open_tracking(LoggingConfig(tensorboard=False), tmp_path, 0, enabled=True) as tracking:
        tracking.write({"kind": "train", "step": 1, "loss": 1.0})
    tracking.close()
    assert isinstance(tracking, Tracking) and tracking.names == []
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"kind": "train", "step": 1, "loss": 1.0}]


def test_mlflow_gets_names_it_accepts(tmp_path, monkeypatch) -> None:
    """A metric name MLflow refuses (``reward/fmt(strict)``) would drop the tracker: it is logged as ``reward/fmt_strict_``."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").resolve().as_uri()
    settings = LoggingConfig(trackers=["mlflow"])
    settings.mlflow.tracking_uri, settings.mlflow.experiment = uri, "names"
    with open_tracking(settings, tmp_path, 0, enabled=True) as tracking:
        tracking.write({"step": 1, "reward/fmt(strict)": 0.5})
        assert tracking.names == ["mlflow"]  # not dropped
    series, _ = mlflow_series(uri, "names", ["reward/fmt_strict_"])
    assert series == {"reward/fmt_strict_": [(1, 0.5)]}
