"""What a run writes about itself: ``metrics.jsonl`` (one JSON record per step and evaluation).

Only rank 0 writes. Each line is flushed when written, so a killed run keeps every step it
logged. A resumed run first drops the records after its checkpoint's step (they belong to the
steps it is about to redo), so the file always reads as one continuous run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"


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
    """Appends records to ``directory/metrics.jsonl`` on rank 0.

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it."""
        if self._file is not None:
            self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None
