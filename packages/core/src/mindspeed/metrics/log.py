"""What a run writes about itself: ``metrics.jsonl`` and ``loss.png`` (and the TensorBoard writer the
``tensorboard`` tracker of :mod:`mindspeed.metrics.backends` opens).

Only rank 0 writes. Each JSONL line is flushed when written, so a killed run keeps every step
it logged. A resumed run first drops the records after its checkpoint's step (they belong to
the steps it is about to redo), so the file always reads as one continuous run; TensorBoard
is told the same (``purge_step``). The loss curve is drawn from the JSONL file at the end, so
it shows the whole run across resumes. TensorBoard and the PNG need the ``tensorboard`` and
``matplotlib`` packages; without them a warning says so and the JSONL file is still written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger, stop_writing

logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOSS_CURVE = "loss.png"


def _plain(value: Any) -> Any:
    # JSON has no NaN/Inf: a skipped step's loss is written as the string "nan" / "inf".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a truncated last line, from a kill, is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends records to ``directory/metrics.jsonl`` on rank 0 (TensorBoard events are the ``tensorboard``
    tracker's: :class:`~mindspeed.metrics.backends.TensorBoardTracker`).

    Args:
        directory: where the file goes (``None``: nothing is written).
        resume_step: the step the run starts after; later records are dropped, and a run from
            step 0 starts a new file.
        enabled: whether this rank writes (rank 0).
    """

    def __init__(self, directory: Path | None, resume_step: int, enabled: bool) -> None:
        self.path = directory / METRICS_FILE if directory is not None and enabled else None
        self._file = None
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step > 0 and self.path.exists():
                kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            self._file = self.path.open("a")
        except OSError as err:  # a full disk: the run goes on without metrics, the old file stays
            self._fail(err)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it."""
        if self._file is not None:
            try:
                self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
                self._file.flush()
            except OSError as err:
                self._fail(err)

    def _fail(self, err: OSError) -> None:
        """Stop writing the file (one warning, no traceback per record): the run goes on."""
        stop_writing(self, f"cannot write metrics to {self.path}: {err}; the run goes on without writing them")
        with contextlib.suppress(Exception):
            if self._file is not None:
                self._file.close()
        self._file = None

    def close(self) -> None:
        """Close the file (a file that cannot be flushed any more is given up quietly: it warned when it failed)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as err:
                stop_writing(self, f"cannot write metrics to {self.path}: {err}")
        self._file = None


def open_tensorboard(directory: Path, resume_step: int) -> Any:
    """A TensorBoard ``SummaryWriter`` in ``directory`` that hides events after ``resume_step``
    (``purge_step``), or None without the ``tensorboard`` package (a warning says so)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("tensorboard is not installed: no TensorBoard event files (pip install tensorboard)")
        return None
    # purge_step: TensorBoard hides the killed run's events from this step on.
    return SummaryWriter(str(directory), purge_step=resume_step + 1 if resume_step else None)


def write_loss_curve(metrics: Path, target: Path) -> Path | None:
    """Draw train and validation loss against the step from a ``metrics.jsonl`` into a PNG.

    Returns:
        The PNG's path, or ``None`` when matplotlib is missing or there is nothing to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: render to a file
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return None
    records = read_metrics(metrics) if metrics.is_file() else []
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and isinstance(r.get("loss"), float)]
    valid = [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval" and isinstance(r.get("loss"), float)]
    if not train:
        return None
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(*zip(*train), label="train", linewidth=1.2)
    if valid:
        axes.plot(*zip(*valid), "o-", label="validation", linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    tmp = target.with_name(target.stem + ".tmp.png")
    try:
        figure.savefig(tmp)
        os.replace(tmp, target)
    except OSError as err:  # a full disk: no curve, one warning
        tmp.unlink(missing_ok=True)
        logger.warning("cannot write the loss curve %s: %s", target, err)
        return None
    finally:
        plt.close(figure)
    return target
