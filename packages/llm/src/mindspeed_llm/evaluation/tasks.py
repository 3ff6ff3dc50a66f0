"""The task registry and the types every evaluation task shares.

A task is registered under its ``--task`` name in :data:`TASKS` and does two things: ``load``
reads and checks its data files (every problem is a ``ValueError`` naming the file, the line and
the fix, raised before a model is loaded), and ``run`` scores an :class:`~mindspeed_llm.evaluation.lm.LM`
on the loaded data and returns a :class:`TaskResult`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from mindspeed.metrics.report import TaskResult
from mindspeed.progress import StatusProgress
from mindspeed.registry import Registry

#: Generation budget when ``--max-new-tokens`` is not given (lm-evaluation-harness's GSM8K setting).
DEFAULT_MAX_NEW_TOKENS = 256


@dataclasses.dataclass
class EvalSettings:
    """Knobs shared by the tasks (the CLI flags of the same names).

    Attributes:
        shots: few-shot examples per prompt; ``None`` takes each task's default (MMLU 5, GSM8K 0).
        max_new_tokens: generation budget of generative tasks; ``None``: :data:`DEFAULT_MAX_NEW_TOKENS`, at most
            half the model's window.
        max_samples: at most this many items per task (per subject for MMLU); ``None`` for all.
        ppl_stride: tokens scored per perplexity window; ``None`` for chunked windows (the window length minus one).
        show_progress: draw progress bars on standard error.
    """

    shots: int | None = None
    max_new_tokens: int | None = None
    max_samples: int | None = None
    ppl_stride: int | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in ("shots", "max_samples"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
        for name in ("max_new_tokens", "ppl_stride"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


class EvalTask(Protocol):
    """What a registered task provides."""

    #: few-shot examples when ``--shots`` is not given.
    default_shots: int

    def load(self, path: Path, settings: EvalSettings) -> Any:
        """Read and check the data under ``path``.

        Raises:
            ValueError: missing files or malformed records, naming the file, the line and the fix.
        """
        ...

    def check(self, lm: Any, settings: EvalSettings) -> None:
        """Check the settings against the loaded model, before any task runs.

        Raises:
            ValueError: a setting the model's window cannot hold, naming the flag and the fix.
        """
        ...

    def run(self, lm: Any, data: Any, settings: EvalSettings) -> TaskResult:
        """Score ``lm`` on data returned by :meth:`load`."""
        ...


#: ``--task`` name -> task.
TASKS: Registry[EvalTask] = Registry("evaluation task")


def require_path(path: Path, what: str, fix: str) -> Path:
    """``path`` if it exists.

    Raises:
        ValueError: naming the missing ``what`` at ``path`` and the ``fix``.
    """
    if not path.exists():
        raise ValueError(f"{what} {str(path)!r} does not exist; {fix}")
    return path


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` for every non-blank line of a JSON Lines file.

    Raises:
        ValueError: a line that is not a JSON object, naming the file and the line.
    """
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def limit(items: list[Any], max_samples: int | None) -> list[Any]:
    """The first ``max_samples`` items (all of them for ``None``)."""
    return items if max_samples is None else items[:max_samples]


def call_in_chunks(fn: Any, items: list[Any], lm: Any, description: str, settings: EvalSettings) -> list[Any]:
    """``fn(items)`` in chunks of a few batches, with a progress bar over the items.

    Args:
        fn: ``LM.loglikelihood`` or a one-argument wrapper of ``LM.generate``.
        items: its requests.
        lm: the model (its ``batch_size`` sets the chunk size).
        description: text of the progress bar.
        settings: ``show_progress`` switches the bar.
    """
    chunk = 4 * max(1, int(getattr(lm, "batch_size", 8)))
    out: list[Any] = []
    with StatusProgress(description, total=len(items), disable=None if settings.show_progress else True) as bar:
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            out.extend(fn(part))
            bar.update(advance=len(part))
    return out
