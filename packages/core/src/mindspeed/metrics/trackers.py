"""One tracking object, many trackers: where every metric record of a run goes (verl's ``Tracking``).

:func:`open_tracking` opens the trackers of ``logging.trackers`` (:mod:`mindspeed.metrics.config`)
on rank 0; other ranks get an empty :class:`Tracking` whose calls do nothing. Every record goes to
every tracker: ``metrics.jsonl`` keeps the record as it is; the other trackers get its finite
numbers (:func:`scalars`: ``kind/name`` when the record has a ``kind``, else ``name``). The
resolved recipe is logged once as the run's config, validation samples as a table or text where
the tracker has one. A tracker other than ``jsonl`` that fails while the run goes on is logged
once as a warning and dropped; the run continues. :meth:`Tracking.close` closes every tracker
(the suites call it on every exit path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mindspeed.config import ConfigError
from mindspeed.log import DETAIL, get_logger
from mindspeed.metrics.backends import LIBRARY_TRACKERS, JsonlTracker, TensorBoardTracker
from mindspeed.metrics.config import EXTRAS, LoggingConfig

logger = get_logger(__name__)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record as tracker scalars (``step``, ``kind``, flags and texts left out).

    ``{"kind": "train", "step": 3, "loss": 2.1, "skipped": False}`` -> ``{"train/loss": 2.1}``;
    a record without ``kind`` (RL) keeps its keys: ``{"reward/acc": 0.5}``.
    """
    kind = record.get("kind")
    prefix = f"{kind}/" if isinstance(kind, str) and kind else ""
    out = {}
    for key, value in record.items():
        if key in ("step", "kind") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[prefix + key] = float(value)
    return out


class Tracking:
    """The run's trackers behind one object (empty on ranks other than 0).

    Args:
        trackers: opened adapters of :mod:`mindspeed.metrics.backends`.
        jsonl_path: the ``metrics.jsonl`` file when the ``jsonl`` tracker is on.
    """

    def __init__(self, trackers: Sequence[Any] = (), jsonl_path: Path | None = None) -> None:
        self.trackers = list(trackers)
        self.path = jsonl_path

    @property
    def names(self) -> list[str]:
        """The names of the trackers still open."""
        return [t.name for t in self.trackers]

    def write(self, record: Mapping[str, Any]) -> None:
        """Send one metric record (with ``step``) to every tracker."""
        numbers: dict[str, float] | None = None
        for tracker in list(self.trackers):
            if isinstance(tracker, JsonlTracker):
                tracker.log_record(record)  # metrics.jsonl's own errors are the log's (mindspeed.metrics.log)
                continue
            numbers = scalars(record) if numbers is None else numbers
            if numbers:
                self._call(tracker, "log_scalars", numbers, int(record["step"]))

    log = write

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the resolved recipe as the run's config / params."""
        for tracker in list(self.trackers):
            if hasattr(tracker, "log_config"):
                self._call(tracker, "log_config", config)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]], name: str = "samples") -> None:
        """Log validation samples (rows of ``column -> text/number``) where a tracker has tables or text."""
        if not rows:
            return
        for tracker in list(self.trackers):
            if hasattr(tracker, "log_samples"):
                self._call(tracker, "log_samples", name, rows, step)

    def close(self) -> None:
        """Close every tracker (a tracker that fails to close is warned about; the others still close)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as err:  # noqa: BLE001 - one tracker's close must not lose the others'
                logger.warning("tracker %s failed to close: %s: %s", tracker.name, type(err).__name__, err)

    def _call(self, tracker: Any, method: str, *args: Any) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # noqa: BLE001 - a tracker must not end the run
            logger.warning(
                "tracker %s failed (%s: %s); it is dropped and the run goes on without it",
                tracker.name,
                type(err).__name__,
                err,
            )
            self.trackers.remove(tracker)
            try:
                tracker.close()
            except Exception:  # noqa: BLE001 - already reported
                pass

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tracking(
    settings: LoggingConfig,
    log_dir: Path | None,
    resume_step: int,
    enabled: bool,
    config: Mapping[str, Any] | None = None,
) -> Tracking:
    """Open the trackers of ``settings`` on this rank (none unless ``enabled``, i.e. rank 0).

    Args:
        settings: the recipe's ``logging`` section.
        log_dir: the run's log directory (``None``: no ``metrics.jsonl`` and no TensorBoard unless
            ``logging.tensorboard_dir`` is set; wandb / mlflow / swanlab use their own defaults).
        resume_step: the step the run starts after (``metrics.jsonl`` and TensorBoard drop what
            follows it; the other trackers start a new run).
        enabled: whether this rank records (rank 0).
        config: the resolved recipe, logged as the run's config.

    Raises:
        ConfigError: a tracker's library is missing (the message names the extra to install).
    """
    if not enabled:
        return Tracking()
    config = dict(config or {})
    opened: list[Any] = []
    jsonl_path = None
    try:
        for name in settings.resolved_trackers():
            if name == "jsonl":
                if log_dir is not None:
                    opened.append(JsonlTracker(log_dir, resume_step))
                    jsonl_path = opened[-1].file.path
            elif name == "tensorboard":
                board = settings.tensorboard_path(log_dir)
                if board is not None:
                    tracker = TensorBoardTracker(board, resume_step)
                    if tracker.board is not None:  # else: tensorboard missing, a warning said so
                        opened.append(tracker)
            else:
                tracker = _open_library_tracker(name, settings, log_dir, config)
                if tracker is not None:
                    opened.append(tracker)
    except BaseException:
        Tracking(opened).close()
        raise
    tracking = Tracking(opened, jsonl_path)
    if config:
        tracking.log_config(config)
    if opened:
        logger.info("trackers: %s", ", ".join(tracking.names), extra=DETAIL)
    return tracking


def _open_library_tracker(name: str, settings: LoggingConfig, log_dir: Path | None, config: Mapping[str, Any]) -> Any:
    """The adapter of ``name``; ``None`` (with a warning) when it cannot start (no login, no server)."""
    try:
        return LIBRARY_TRACKERS[name](settings, log_dir, config)
    except ImportError as err:
        module, extra = EXTRAS[name]
        raise ConfigError(
            f"logging.trackers lists {name} but {module} cannot be imported ({err}): "
            f"pip install 'mindspeed-core[{extra}]'"
        ) from err
    except Exception as err:  # noqa: BLE001 - a tracker must not stop the run
        logger.warning("tracker %s could not start (%s: %s); the run goes on without it", name, type(err).__name__, err)
        return None
