"""Progress bars that only rank 0 draws, on top of rich."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mindspeed.log import get_rank


class StatusProgress:
    """A progress bar whose status text the loop updates (loss, tokens/s ...); rank 0 only.

    Use as a context manager: ``with StatusProgress("train", total=n) as bar: bar.update(status=...)``.
    """

    def __init__(self, description: str, total: int, disable: bool | None = None) -> None:
        self.disable = get_rank() != 0 if disable is None else disable
        self._progress = None if self.disable else Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=Console(stderr=True),
        )
        self._description, self._total, self._task = description, total, None

    def __enter__(self) -> StatusProgress:
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task(self._description, total=self._total, status="")
        return self

    def update(self, advance: int = 1, status: str = "") -> None:
        """Advance the bar and replace its status text."""
        if self._progress is not None:
            self._progress.update(self._task, advance=advance, status=status)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
