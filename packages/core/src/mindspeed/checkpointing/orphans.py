"""No orphans: processes a run starts die with it, even when it is killed with SIGKILL.

:func:`die_with_parent` asks the kernel to kill this process when its parent dies
(``PR_SET_PDEATHSIG`` on Linux; a polling thread elsewhere). :func:`forked_children_die_with_me`
applies it to every process forked while it is active: megatron's ``dist_checkpointing``
writer forks one writer per file bucket, and a writer whose trainer was killed would
otherwise run on with parent 1 (holding the checkpoint's tensors in memory). Forked writers
also ignore SIGINT: a Ctrl-C in the terminal reaches the whole process group, and the trainer,
not its writers, decides what an interrupt means.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from mindspeed.checkpointing.faults import child_fault, child_write_fault

_PR_SET_PDEATHSIG = 1
_guarding: list[int] = []  # the pids whose forked children must die with them
_registered = False


def die_with_parent(parent: int | None = None) -> None:
    """Have this process killed (SIGKILL) when ``parent`` (default: the current parent) dies.

    Exits at once when the parent is already gone (it died before the request was made).
    """
    parent = os.getppid() if parent is None else parent
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()


def _after_fork_in_child() -> None:
    if not _guarding or _guarding[-1] != os.getppid():
        _guarding.clear()  # a grandchild, or a fork outside the guarded block: not ours
        return
    parent = _guarding[-1]
    _guarding.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    child_fault("save.writer")
    child_write_fault("save.write")


@contextlib.contextmanager
def forked_children_die_with_me() -> Iterator[None]:
    """Every process forked inside this block dies with this process (and ignores SIGINT)."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _registered = True
    _guarding.append(os.getpid())
    try:
        yield
    finally:
        _guarding.pop()
