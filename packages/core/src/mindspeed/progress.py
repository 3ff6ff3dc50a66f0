"""Progress bars that only rank 0 draws, on top of rich, laid out to fit the terminal's width.

A line reads ``pretrain ━━━━━━━━╸━━━━━ 12/300 0:00:05 ETA 0:01:55 loss 10.4567 lr 0.000123 ...``.
When it does not fit, the parts give way in this order: the status fields (from the last, so the
first one, the loss, goes last), then the bar (down to :data:`BAR_MIN_WIDTH` columns, then away),
then the description (cut with an ellipsis), then the elapsed time. The step count and the time
left always stay: they are what a glance at the bar is for.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import BarColumn, MofNCompleteColumn, Progress, Task, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from mindspeed.log import get_rank

#: Columns the bar takes while the status fields need the room; it grows to :data:`BAR_MAX_WIDTH` when they fit.
BAR_WIDTH = 20
#: The narrowest bar drawn (narrower: none).
BAR_MIN_WIDTH = 5
#: The widest bar drawn (rich's default).
BAR_MAX_WIDTH = 40

_COUNT, _ELAPSED, _LEFT = MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def fit_fields(fields: Sequence[str], room: int, separator: str = " ") -> list[str]:
    """The leading ``fields`` whose join by ``separator`` fits in ``room`` columns (the first that does not ends them)."""
    kept: list[str] = []
    used = 0
    for field in fields:
        need = len(field) + (len(separator) if kept else 0)
        if used + need > room:
            break
        kept.append(field)
        used += need
    return kept


class _TaskLine:
    """One task's line, laid out at render time for the width the console gives it."""

    def __init__(self, task: Task, separator: str) -> None:
        self.task, self.separator = task, separator

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        task, width = self.task, options.max_width
        count, left = _COUNT.render(task), Text.assemble("ETA ", _LEFT.render(task))
        elapsed, description = _ELAPSED.render(task), str(task.description)
        fields = [f for f in task.fields.get("status", ()) if f]
        room = width - count.cell_len - 1 - left.cell_len  # count and time left: always
        show_elapsed = room >= elapsed.cell_len + 1
        room -= elapsed.cell_len + 1 if show_elapsed else 0
        description = description[: max(room - 1, 0)]
        if len(description) < len(str(task.description)):  # cut: say so
            description = description[:-1] + "…" if len(description) > 1 else ""
        room -= len(description) + 1 if description else 0
        bar = min(BAR_WIDTH, room - 1)
        bar = bar if bar >= BAR_MIN_WIDTH else 0
        room -= bar + 1 if bar else 0
        kept = fit_fields(fields, room - 1, self.separator)
        status = self.separator.join(kept)
        room -= len(status) + 1 if status else 0
        if bar:
            bar += max(0, min(BAR_MAX_WIDTH - bar, room))  # what is left over widens the bar
        parts: list[tuple[object, int]] = [(Text(description), len(description))] if description else []
        if bar:
            parts.append((BarColumn(bar_width=bar).render(task), bar))
        parts.append((count, count.cell_len))
        if show_elapsed:
            parts.append((elapsed, elapsed.cell_len))
        parts.append((left, left.cell_len))
        if status:
            parts.append((Text(status), len(status)))
        table = Table.grid(padding=(0, 1))
        for _, size in parts:
            table.add_column(width=size, no_wrap=True)
        table.add_row(*(part for part, _ in parts))
        yield table


class _FittedProgress(Progress):
    """A rich ``Progress`` whose every task is a :class:`_TaskLine`."""

    def __init__(self, console: Console, separator: str) -> None:
        super().__init__(console=console)
        self._separator = separator

    def get_renderables(self) -> Iterable[_TaskLine]:  # noqa: D102 -- rich's
        for task in self.tasks:
            if task.visible:
                yield _TaskLine(task, self._separator)


class StatusProgress:
    """A progress bar whose status fields the loop updates (loss, tokens/s ...); rank 0 only.

    Use as a context manager: ``with StatusProgress("train", total=n) as bar: bar.update(status=[...])``.
    The bar shows the description (name the stage: pretrain, sft ...), the steps, the time taken,
    the time left (estimated from the steps of this process, not those it resumed after) and the
    status fields, fitted to the terminal's width (see the module's docstring).

    Args:
        description: text left of the bar.
        total: steps of the whole run.
        disable: force the bar off (``None``: off on ranks other than 0 and when standard error is
            not a terminal).
        completed: steps already done before this process (a resumed run).
        console: where to draw (default: standard error).
        separator: put between the status fields.
    """

    def __init__(
        self,
        description: str,
        total: int | None,
        disable: bool | None = None,
        completed: int = 0,
        console: Console | None = None,
        separator: str = " ",
    ) -> None:
        # Off in logs (standard error not a terminal): a bar drawn once at the end would only repeat the log lines.
        self.disable = (get_rank() != 0 or not _is_terminal()) if disable is None else disable
        self._progress = None if self.disable else _FittedProgress(console or Console(stderr=True), separator)
        self._description, self._total, self._completed, self._task = description, total, completed, None

    def __enter__(self) -> StatusProgress:
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task(
                self._description,
                total=self._total,
                completed=self._completed,
                status=("resumed",) if self._completed else (),
            )
        return self

    def update(self, advance: int = 1, status: str | Sequence[str] = "", completed: int | None = None) -> None:
        """Advance the bar (or set the steps done to ``completed``) and replace its status.

        Args:
            advance: steps to add.
            status: the status fields, most important first (the last ones are dropped when the
                line is short of room); a string is one field.
            completed: the steps done (instead of ``advance``).
        """
        if self._progress is not None:
            fields = (status,) if isinstance(status, str) else tuple(status)
            if completed is None:
                self._progress.update(self._task, advance=advance, status=fields)
            else:
                self._progress.update(self._task, completed=completed, status=fields)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
