"""Progress bars that only rank 0 draws, on top of rich."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from mindspeed.log import get_rank


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class StatusProgress:
    """A progress bar whose status text the loop updates (loss, tokens/s ...); rank 0 only.

    Use as a context manager: ``with StatusProgress("train", total=n) as bar: bar.update(status=...)``.
    The bar shows the description (name the stage: pretrain, sft ...), the steps, the time taken
    and the time left (estimated from the steps of this process, not those it resumed after).

    Args:
        description: text left of the bar.
        total: steps of the whole run.
        disable: force the bar off (``None``: off on ranks other than 0 and when standard error is
            not a terminal).
        completed: steps already done before this process (a resumed run).
    """

    def __init__(self, description: str, total: int, disable: bool | None = None, completed: int = 0) -> None:
        # Off in logs (standard error not a terminal): a bar drawn once at the end would only repeat the log lines.
        self.disable = (get_rank() != 0 or not _is_terminal()) if disable is None else disable
        self._progress = (
            None
            if self.disable
            else Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=Console(stderr=True),
            )
        )
        self._description, self._total, self._completed, self._task = description, total, completed, None

    def __enter__(self) -> StatusProgress:
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task(
                self._description,
                total=self._total,
                completed=self._completed,
                status="resumed" if self._completed else "",
            )
        return self

    def update(self, advance: int = 1, status: str = "") -> None:
        """Advance the bar and replace its status text."""
        if self._progress is not None:
            self._progress.update(self._task, advance=advance, status=status)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
