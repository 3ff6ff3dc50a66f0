"""One adapter per experiment tracker behind :class:`~mindspeed.metrics.trackers.Tracking`.

Each adapter takes the run's scalars (``name -> float`` at a step), the resolved recipe (once, as
the run's config / params) and validation samples (rows of text, as a table where the tracker has
one), and closes its run. The libraries are imported when a tracker is opened, never at import:
each is an optional extra of ``mindspeed-core``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mindspeed.log import get_logger
from mindspeed.metrics.config import LoggingConfig
from mindspeed.metrics.log import MetricsLog, open_tensorboard

logger = get_logger(__name__)

Rows = Sequence[Mapping[str, Any]]
_MLFLOW_NAME = re.compile(r"[^\w\-./: ]")


def _columns(rows: Rows) -> list[str]:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return list(names)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (the form of MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class JsonlTracker:
    """``metrics.jsonl``: every record as written (:class:`~mindspeed.metrics.log.MetricsLog`)."""

    name = "jsonl"

    def __init__(self, directory: Path, resume_step: int) -> None:
        self.file = MetricsLog(directory, resume_step, enabled=True)

    def log_record(self, record: Mapping[str, Any]) -> None:
        self.file.write(dict(record))

    def close(self) -> None:
        self.file.close()


class TensorBoardTracker:
    """TensorBoard events: scalars, the recipe as text, samples as a markdown table."""

    name = "tensorboard"

    def __init__(self, directory: Path, resume_step: int) -> None:
        self.board = open_tensorboard(directory, resume_step)

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        if self.board is None:
            return
        for key, value in scalars.items():
            self.board.add_scalar(key, value, step)
        self.board.flush()  # a killed run keeps its events, as it keeps its JSONL lines

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self.board is not None:
            self.board.add_text("config", "```yaml\n" + yaml.safe_dump(dict(config), sort_keys=False) + "```", 0)

    def log_samples(self, name: str, rows: Rows, step: int) -> None:
        if self.board is None or not rows:
            return
        columns = _columns(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in rows:
            cells = (str(row.get(c, "")).replace("|", "\\|").replace("\n", "<br>") for c in columns)
            lines.append("| " + " | ".join(cells) + " |")
        self.board.add_text(name, "\n".join(lines), step)
        self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


class WandbTracker:
    """Weights & Biases: one run per training run, the recipe as its config, samples as a ``wandb.Table``."""

    name = "wandb"

    def __init__(self, settings: LoggingConfig, log_dir: Path | None, config: Mapping[str, Any]) -> None:
        import wandb

        w = settings.wandb
        directory = w.dir or (str(log_dir) if log_dir is not None else None)
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        # console="off": W&B does not wrap our stdout/stderr; stats off: no system-metrics sampler.
        self.run = wandb.init(
            project=w.project,
            name=w.name,
            mode=w.mode,
            dir=directory,
            config=dict(config),
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass  # given to wandb.init

    def log_samples(self, name: str, rows: Rows, step: int) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow through ``MlflowClient`` (no global active run): metrics, the recipe as params, samples as JSON."""

    name = "mlflow"

    def __init__(self, settings: LoggingConfig, log_dir: Path | None, config: Mapping[str, Any]) -> None:
        m = settings.mlflow
        uri = m.tracking_uri
        if uri is None and log_dir is not None:
            uri = (log_dir / "mlruns").resolve().as_uri()
        if uri is not None and (uri.startswith("file:") or "://" not in uri):
            # MLflow 3 asks for this before it opens a local file store (its maintenance mode).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric, self.param = Metric, Param
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(m.experiment)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(m.experiment)
        self.run_id = self.client.create_run(experiment, run_name=m.run_name).info.run_id

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        # MLflow names allow letters, digits and _ - . / : and space: anything else becomes "_".
        metrics = [self.metric(_MLFLOW_NAME.sub("_", key), value, now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [self.param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flatten(config).items()]
        params = [self.param(p.key, p.value[:6000]) for p in params]  # MLflow's value limit
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_samples(self, name: str, rows: Rows, step: int) -> None:
        text = json.dumps([dict(row) for row in rows], indent=1, default=str)
        self.client.log_text(self.run_id, text, f"{name}/step_{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class SwanlabTracker:
    """SwanLab: metrics, the recipe as its config, samples as ``swanlab.Text`` (one per row)."""

    name = "swanlab"

    def __init__(self, settings: LoggingConfig, log_dir: Path | None, config: Mapping[str, Any]) -> None:
        import swanlab

        s = settings.swanlab
        logdir = s.logdir or (str(log_dir / "swanlog") if log_dir is not None else None)
        if logdir is not None:
            Path(logdir).mkdir(parents=True, exist_ok=True)
        self.swanlab = swanlab
        self.run = swanlab.init(
            project=s.project, mode=s.mode, log_dir=logdir, config=dict(config), reinit=True, settings=_swanlab_quiet()
        )

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass  # given to swanlab.init

    def log_samples(self, name: str, rows: Rows, step: int) -> None:
        texts = [self.swanlab.Text(json.dumps(dict(row), ensure_ascii=False, default=str)) for row in rows]
        self.run.log({name: texts}, step=step)

    def close(self) -> None:
        self.run.finish()


def _swanlab_quiet() -> Any:
    """SwanLab settings without stdout capture, hardware sampler or key prompt (``None`` on versions without them)."""
    try:
        from swanlab.sdk.internal.settings import Settings
    except ImportError:
        return None
    # A training run's console is ours; a run on a node without a terminal must not wait for a key.
    return Settings(
        interactive=False,
        terminal={"proxy_type": "none"},
        probe={"monitor": False, "requirements": False, "git": False, "conda": False},
    )


#: Tracker name -> adapter that needs the tracker's library (opened with settings, log dir, config).
LIBRARY_TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "swanlab": SwanlabTracker}
