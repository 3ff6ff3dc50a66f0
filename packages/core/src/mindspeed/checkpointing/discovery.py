"""Which checkpoint to resume from: the newest *complete* one, found by scanning, never by trust.

A save directory holds one directory per saved step, named by a :class:`Layout` (megatron's
``iter_0000100/`` by default, :data:`ITER`; the multimodal trainer's ``step_00000100/``,
:data:`STEP`), and megatron's tracker file ``latest_checkpointed_iteration.txt``. A writer
finishes a checkpoint by writing :data:`MARKER` into it last: the list of its files with their
sizes. A checkpoint is complete when the marker is there and every file it lists exists with
that size (a cheap check: sizes, not contents). :func:`find_resume` scans every step
directory, newest first, and takes
the first complete one; each newer damaged one (a shard missing or truncated, no marker) and a
tracker that names a missing or damaged step are reported in one warning line each.

:func:`rotate` deletes old checkpoints (``keep_last``): it counts and deletes complete ones
only, and never the newest complete one nor the one just written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Written last into a checkpoint directory: ``{"step": N, "files": {relative path: bytes}}``.
MARKER = "complete.json"
#: Megatron's tracker file: the step of the newest checkpoint (advisory here).
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Layout:
    """How a suite names the directory of a step: ``prefix`` and the step in ``digits`` digits."""

    prefix: str = "iter_"
    digits: int = 7

    def dir(self, root: str | Path, step: int) -> Path:
        """``root/<prefix><step>``."""
        return Path(root) / f"{self.prefix}{step:0{self.digits}d}"

    def step_of(self, path: str | Path) -> int | None:
        """The step a directory name stands for (``None`` for any other name)."""
        name = Path(path).name
        digits = name[len(self.prefix) :]
        if name.startswith(self.prefix) and len(digits) == self.digits and digits.isascii() and digits.isdigit():
            return int(digits)
        return None


#: megatron's ``iter_0000123`` (the LLM trainer, the RL driver).
ITER = Layout()
#: ``step_00000123`` (the multimodal trainer's torch DCP checkpoints).
STEP = Layout("step_", 8)


def checkpoint_dir(root: str | Path, step: int, layout: Layout = ITER) -> Path:
    """``root/iter_0000123`` for step 123 (in ``layout``)."""
    return layout.dir(root, step)


def step_of(path: str | Path, layout: Layout = ITER) -> int | None:
    """The step of an ``iter_XXXXXXX`` directory name (in ``layout``; ``None`` for any other name)."""
    return layout.step_of(path)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_marker(directory: str | Path, step: int) -> Path:
    """Record every file of ``directory`` with its size in :data:`MARKER`; call it after the last file is written.

    The marker itself is written to a temporary name, flushed and renamed, so it is either
    absent or whole.
    """
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")
    }
    tmp = directory / (MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump({"step": step, "files": files}, out, indent=0)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, directory / MARKER)
    fsync_dir(directory)
    return directory / MARKER


def damage_of(directory: str | Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or ``None`` when it is."""
    directory = Path(directory)
    if not directory.is_dir():
        return "the directory is missing"
    marker = directory / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} (a save that did not finish, or a checkpoint of another writer)"
    try:
        files = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MARKER} is unreadable"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"file {name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} is truncated ({actual} of {size} bytes)"
    return None


def is_complete(directory: str | Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint (see :func:`damage_of`)."""
    return damage_of(directory) is None


def list_step_dirs(root: str | Path, layout: Layout = ITER) -> list[Path]:
    """Every ``iter_XXXXXXX`` directory (in ``layout``) under ``root``, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if layout.step_of(p) is not None and p.is_dir()), key=lambda p: p.name)


def list_complete(root: str | Path, layout: Layout = ITER) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    return [p for p in list_step_dirs(root, layout) if is_complete(p)]


def holds_checkpoints(root: str | Path, layout: Layout = ITER) -> bool:
    """Whether ``root`` holds checkpoints of some run, complete or not (a step directory or a tracker)."""
    root = Path(root)
    return bool(list_step_dirs(root, layout)) or (root / TRACKER).is_file()


def tracker_step(root: str | Path) -> int | None:
    """The step the tracker names (``None`` when there is none or it is unreadable)."""
    try:
        text = (Path(root) / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(root: str | Path, step: int) -> None:
    """Point megatron's tracker at ``step`` (temporary file + rename)."""
    root = Path(root)
    tmp = root / (TRACKER + ".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root / TRACKER)
    fsync_dir(root)


@dataclass
class ResumePoint:
    """What :func:`find_resume` found in a save directory.

    Attributes:
        path: the newest complete checkpoint (``None``: there is none).
        skipped: ``(checkpoint, why)`` of each damaged checkpoint newer than ``path``.
        layout: how the step directories are named.
    """

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    layout: Layout = ITER

    @property
    def step(self) -> int | None:
        """The step of :attr:`path`."""
        return self.layout.step_of(self.path) if self.path is not None else None


def find_resume(root: str | Path, warn: bool = True, layout: Layout = ITER) -> ResumePoint:
    """The newest complete checkpoint under ``root``; damaged newer ones are skipped with one warning each.

    Args:
        root: a save directory.
        warn: log one warning line per damaged checkpoint skipped (and for a tracker that names
            a missing one) when a complete one is found.
        layout: how the step directories are named.
    """
    root = Path(root)
    found = ResumePoint(None, layout=layout)
    for path in reversed(list_step_dirs(root, layout)):
        why = damage_of(path)
        if why is None:
            found.path = path
            break
        found.skipped.append((path, why))
    named = tracker_step(root)
    if named is not None and not layout.dir(root, named).exists() and (found.step or -1) < named:
        found.skipped.insert(0, (layout.dir(root, named), f"the directory is missing ({TRACKER} names it)"))
    if warn and found.path is not None:  # with none left, the caller's error says it all
        for path, why in found.skipped:
            logger.warning("checkpoint %s is damaged and skipped: %s; resuming from %s", path, why, found.path.name)
    return found


def remove_tree(path: Path) -> None:
    """Delete a checkpoint directory; renamed first, so that a kill halfway leaves no half checkpoint."""
    if path.exists():
        doomed = path.with_name(path.name + ".deleting")
        if doomed.exists():
            shutil.rmtree(doomed)
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def rotate(root: str | Path, keep_last: int | None, written: Path, layout: Layout = ITER) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``; returns the deleted ones.

    Only complete checkpoints are counted and deleted (damaged ones are left for a person to
    look at); ``written`` (the checkpoint just saved) and the newest complete checkpoint are
    never deleted, whatever their steps.
    """
    if not keep_last:
        return []
    complete = list_complete(root, layout)
    doomed = [p for p in complete[:-keep_last] if p != Path(written) and p != complete[-1]]
    for path in doomed:
        remove_tree(path)
    return doomed
