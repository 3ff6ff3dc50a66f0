"""The progress bar fits the terminal: the step count and the time left stay, the status fields give way first."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from mindspeed.progress import StatusProgress

FIELDS = ["loss 10.4567", "lr 0.000123", "gnorm 1.234", "12,345 tok/s", "MFU 12.34%"]
ETA = re.compile(r"ETA \d+:\d\d:\d\d")


def draw(width: int, description: str = "pretrain", fields: list[str] = FIELDS) -> str:
    """The bar's last line at ``width`` columns after 12 of 300 steps (two of them 10 ms apart: an ETA is known)."""
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    with StatusProgress(description, total=300, disable=False, console=console) as bar:
        bar.update(advance=11, status=fields)
        time.sleep(0.01)
        bar.update(status=fields)
    return console.export_text(clear=False).splitlines()[-1]


def shown_fields(line: str) -> list[str]:
    return [f for f in FIELDS if f in line]


def test_bar_fits_80_and_60_columns_keeping_steps_and_eta() -> None:
    lines = {width: draw(width) for width in (160, 120, 100, 80, 60, 40, 25)}
    for width, line in lines.items():
        assert len(line) <= width, (width, line)
        assert " 12/300 " in line and ETA.search(line), (width, line)  # the count and the time left, always
        assert shown_fields(line) == FIELDS[: len(shown_fields(line))], line  # the last fields go first
    assert shown_fields(lines[160]) == FIELDS and "━" in lines[160]
    assert "pretrain" in lines[80] and "loss 10.4567" in lines[80] and "MFU" not in lines[80]
    assert re.search(r"12/300 \d:\d\d:\d\d ETA", lines[80])  # the time taken too
    assert "pretrain" in lines[60] and shown_fields(lines[60]) == []  # then the bar shrinks
    assert "━" not in lines[25] and "pretrain" not in lines[25]  # at last the bar and the name give way
    # The fields go before the bar does: never fields next to a bar narrower than its usual 20 columns.
    for line in lines.values():
        bar = re.search(r"[━╸╺ ]+(?= 12/300)", line)
        assert not shown_fields(line) or (bar and len(bar.group()) >= 20), line


def test_a_long_description_is_cut_with_an_ellipsis_and_a_string_status_is_one_field() -> None:
    line = draw(40, description="evaluate a-very-long-task-name", fields=["acc 0.500"])
    assert len(line) <= 40 and " 12/300 " in line and ETA.search(line) and "…" in line
    assert "acc 0.500" in draw(100, fields="acc 0.500")  # type: ignore[arg-type] -- the str form
