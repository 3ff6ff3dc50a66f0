"""Read each tracker's own records back (offline files, each through its library's reader) for the tests.

Every reader returns ``{metric name: [(step, value), ...]}`` in step order, to compare with what
:func:`mindspeed.metrics.trackers.scalars` makes of ``metrics.jsonl``'s records.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mindspeed.metrics.log import read_metrics
from mindspeed.metrics.trackers import scalars

Series = dict[str, list[tuple[int, float]]]

#: What a test sets so no tracker logs in or uploads (also what docs/trackers.md tells users).
OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "MLFLOW_ALLOW_FILE_STORE": "true",
    "SWANLAB_MODE": "offline",
}


def offline_overrides(log_dir: Path) -> list[str]:
    """Recipe overrides that turn every tracker on, offline, with its files under ``log_dir``."""
    return [
        "logging.trackers=[jsonl, tensorboard, wandb, mlflow, swanlab]",
        "logging.wandb.mode=offline",
        "logging.swanlab.mode=offline",
        f"logging.mlflow.tracking_uri={(log_dir / 'mlruns').resolve().as_uri()}",
    ]


def jsonl_series(path: Path) -> Series:
    """The tracker scalars of a ``metrics.jsonl`` (later records of a step win, as in the trackers)."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for record in read_metrics(path):
        for key, value in scalars(record).items():
            series[key][int(record["step"])] = value
    return {key: sorted(points.items()) for key, points in series.items()}


def tensorboard_series(directory: Path) -> Series:
    """Scalars of TensorBoard's event files, through its ``EventAccumulator`` (float32 values)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_series(tracking_uri: str, experiment: str, keys: list[str]) -> tuple[Series, dict[str, str]]:
    """``MlflowClient().get_metric_history`` of ``keys`` in the experiment's only run, and its params."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([found.experiment_id])
    series = {}
    for key in keys:
        history = client.get_metric_history(run.info.run_id, key)
        series[key] = sorted((m.step, m.value) for m in history)
    return series, dict(run.data.params)


def _leveldb_log(path: Path, header: int = 7, block: int = 32768) -> Iterator[bytes]:
    """The records of a W&B / SwanLab run file (LevelDB's log format after a 7-byte file header)."""
    data, index, pending = path.read_bytes(), header, b""
    while index + 7 <= len(data):
        if block - index % block < 7:  # too little room left in the block for a header: padding
            index += block - index % block
            continue
        _, length, kind = struct.unpack("<IHB", data[index : index + 7])
        if length == 0 and kind == 0:
            break
        pending += data[index + 7 : index + 7 + length]
        index += 7 + length
        if kind in (1, 4):  # FULL or LAST
            yield pending
            pending = b""


def wandb_run(directory: Path) -> tuple[Series, dict[str, Any], list[Path]]:
    """An offline W&B run under ``directory/wandb``: its history (from the ``.wandb`` file's records,
    parsed with W&B's own protobuf classes), its config, and its table files."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    series: dict[str, dict[int, float]] = defaultdict(dict)
    config: dict[str, Any] = {}
    for raw in _leveldb_log(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                if len(item.nested_key) > 1:  # a table's own fields (nrows, path, ...)
                    continue
                key = item.nested_key[0] if item.nested_key else item.key
                value = json.loads(item.value_json)
                if not key.startswith("_") and isinstance(value, (int, float)):
                    series[key][step] = float(value)
        elif kind in ("run", "config"):  # the config given to wandb.init, then any updates
            for item in (record.run.config if kind == "run" else record.config).update:
                config[item.key] = json.loads(item.value_json)
    tables = sorted(run_file.parent.glob("files/media/table/**/*.table.json"))
    return {key: sorted(points.items()) for key, points in series.items()}, config, tables


def swanlab_run(logdir: Path) -> tuple[Series, Path, list[Any]]:
    """An offline SwanLab run under ``logdir``: its scalars (read with SwanLab's own ``DataStoreReader``
    and record protobuf), its config file, and its text records."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (run_file,) = logdir.glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(run_file)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    media = []
    while (raw := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "scalar":
            series[record.scalar.key][record.scalar.step] = record.scalar.value.number
        elif kind == "media":
            media.append(record.media)
    return (
        {key: sorted(points.items()) for key, points in series.items()},
        run_file.parent / "files" / "config.yaml",
        media,
    )


class NoNetwork:
    """Refuses every socket connection of this process that is not to the loopback host or a unix socket.

    W&B's service and SwanLab's workers talk to this process over loopback; anything else would be a
    login or an upload.
    """

    def __enter__(self) -> NoNetwork:
        self.attempts: list[Any] = []
        self._connect = socket.socket.connect
        guard = self

        def connect(sock: socket.socket, address: Any) -> Any:
            host = address[0] if isinstance(address, tuple) else None
            if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
                guard.attempts.append(address)
                raise OSError(f"test: no network ({address})")
            return guard._connect(sock, address)

        socket.socket.connect = connect  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        socket.socket.connect = self._connect  # type: ignore[method-assign]
