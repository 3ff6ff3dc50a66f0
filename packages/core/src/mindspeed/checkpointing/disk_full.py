"""A full disk during a save is one line: the directory, the space needed and free, the resume point.

A save that runs out of space (``ENOSPC``, or ``EDQUOT`` past a quota) fails deep in a writer:
torch's zip writer, a thread of torch DCP's file writer, or one of the processes megatron's
writer forks, whose error reaches the trainer as a message inside a ``RuntimeError`` (or only as
torch's ``unexpected pos`` when a short write lost the errno). :func:`save_guard` wraps a whole
save: a failure whose chain names ``ENOSPC``/``EDQUOT``, or any failure while the file system
has less than 1 MiB left, removes the half-written ``.tmp`` directory and becomes a
:class:`DiskFullError`: the suites' command lines print its one line and exit 1 (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mindspeed.checkpointing.discovery import ITER, Layout, list_complete

#: The errors of a file system without room (no space, quota exceeded).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: Free bytes below which a failed save is taken for a full disk even when its error lost the errno
#: (torch's zip writer after a short write says only ``unexpected pos``).
ALMOST_FULL = 1 << 20
_WORDS = tuple(os.strerror(code) for code in NO_SPACE) + tuple(f"[Errno {code}]" for code in NO_SPACE)


class DiskFullError(RuntimeError):
    """A save that ran out of space; its message is the one line the user sees (exit 1)."""


def names_no_space(err: BaseException) -> bool:
    """Whether ``err``, its causes, or the per-rank failures it carries (DCP's ``CheckpointException``) say "no space"."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            if isinstance(item, (tuple, list)):
                todo.extend(item)
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in NO_SPACE:
            return True
        if any(word in str(item) for word in _WORDS):
            return True
        todo.extend((item.__cause__, item.__context__, *item.args))
        failures = getattr(item, "failures", None)  # torch DCP: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo.extend(failures.values())
    return False


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _mb(size: int) -> str:
    return f"{size / 2**30:.1f} GB" if size >= 2**30 else f"{size / 2**20:.1f} MB"


def _free(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def disk_full_message(root: Path, target: Path, needed: int, previous: Path | None, free: int) -> str:
    """The one line: what could not be saved where, the space needed and free, and the resume point."""
    resume = (
        f"the previous complete checkpoint {previous} is the resume point"
        if previous is not None
        else "no complete checkpoint exists yet"
    )
    return (
        f"no space left on the file system of {root} to save {target.name}: it needs about {_mb(needed)} "
        f"(the size of {previous.name if previous is not None else 'what it had written'}) and {_mb(free)} is free; "
        f"{resume}; free space (or set checkpoint.keep_last, or another checkpoint.save) and run the same command "
        "to resume"
    )


@contextlib.contextmanager
def save_guard(root: str | Path, target: Path, remove_tmp: bool = True, layout: Layout = ITER) -> Iterator[None]:
    """Turn a save that ran out of space into a :class:`DiskFullError` and remove its ``.tmp`` directory.

    Args:
        root: the save directory (``checkpoint.save``, or an export's directory).
        target: the directory being written (its ``.tmp`` sibling is removed on failure).
        remove_tmp: whether this process removes the ``.tmp`` directory (rank 0 only; the other
            ranks raise the same error).
        layout: how the complete checkpoints of ``root`` are named.
    """
    root = Path(root)
    try:
        yield
    except (DiskFullError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # torch DCP's CheckpointException is a BaseException
        tmp = target.with_name(target.name + ".tmp")
        written = tree_size(tmp)
        free = _free(root)
        if not (names_no_space(err) or free < ALMOST_FULL):
            raise
        if remove_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            free = _free(root)  # what the user has once the half-written save is gone
        previous = (list_complete(root, layout) or [None])[-1] if root.is_dir() else None
        needed = tree_size(previous) if previous is not None else 0
        raise DiskFullError(disk_full_message(root, target, max(needed, written), previous, free)) from err


@contextlib.contextmanager
def export_guard(target: str | Path, *staging: Path) -> Iterator[None]:
    """:func:`save_guard` for an export (``checkpoint.save_hf``): ``staging`` (the half-written directories) is removed.

    The export runs after the last checkpoint, which stays complete: the message says so.
    """
    target = Path(target)
    try:
        yield
    except (DiskFullError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:
        parent = target.parent
        free = _free(parent)
        if not (names_no_space(err) or free < ALMOST_FULL):
            raise
        written = sum(tree_size(path) for path in staging)
        for path in staging:
            shutil.rmtree(path, ignore_errors=True)
        raise DiskFullError(
            f"no space left on the file system of {parent} to export {target.name}: {_mb(written)} were written "
            f"before it failed (now removed) and {_mb(_free(parent))} is free; the run's checkpoints are complete; "
            "free space (or give checkpoint.save_hf another file system) and export the newest checkpoint with the "
            "suite's convert command (docs/reliability.md)"
        ) from err
