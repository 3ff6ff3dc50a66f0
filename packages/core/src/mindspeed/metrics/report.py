"""The evaluation report: the scores of a task, a plain-text table for the terminal and a JSON file for tools."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class TaskResult:
    """The scores of one task.

    Attributes:
        task: the task name.
        metric: name of the headline metric.
        value: its value.
        n: number of scored items (tokens for perplexity).
        metrics: every metric of the task, the headline included.
        groups: per-group metrics (MMLU subjects: ``{"acc": ..., "n": ...}``).
        samples: one record per item (prompt index, prediction, target, correct ...).
        settings: the task settings that shaped the scores (shots, data path, window ...).
    """

    task: str
    metric: str
    value: float
    n: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    groups: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self, with_samples: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; per-item samples only when asked for."""
        out = dataclasses.asdict(self)
        if not with_samples:
            out.pop("samples")
        return out


def table_rows(results: list[TaskResult]) -> list[tuple[str, str, str, str]]:
    """``(task, metric, value, n)`` rows: every metric of every task, then MMLU's subjects indented."""
    rows = []
    for result in results:
        for metric, value in result.metrics.items():
            if metric == "tokens":  # already the n column of perplexity
                continue
            rows.append((result.task, metric, f"{value:.4f}", str(result.n)))
        for group, values in result.groups.items():
            rows.append(
                (f"  {result.task}/{group}", result.metric, f"{values[result.metric]:.4f}", str(int(values["n"])))
            )
    return rows


def format_table(results: list[TaskResult]) -> str:
    """The results as an aligned plain-text table (task, metric, value, n)."""
    rows = [("task", "metric", "value", "n"), *table_rows(results)]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines = []
    for k, row in enumerate(rows):
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]:>{widths[3]}}")
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_report(results: list[TaskResult], settings: dict[str, Any], with_samples: bool = False) -> dict[str, Any]:
    """The JSON document: the run's settings and one entry per task."""
    return {"settings": settings, "results": [r.to_json(with_samples) for r in results]}


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write ``document`` to ``path`` under a temporary name and rename it, so no half-written file is left.

    Raises:
        ValueError: the parent directory cannot be created.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--output {str(path)!r}: cannot create its directory ({err.strerror})") from err
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
