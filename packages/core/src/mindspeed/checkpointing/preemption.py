"""Preemption: SIGTERM, Ctrl-C and a time limit end a run cleanly, after a checkpoint.

A training loop wraps itself in a :class:`Preemption` and asks :meth:`Preemption.agree`
between steps. SIGTERM and the first SIGINT only set a flag: the current step finishes, the
loop saves (unless this step is saved already) and the command exits with
:data:`EXIT_SIGTERM` (143) or :data:`EXIT_SIGINT` (130) and one line naming the checkpoint. A
second SIGINT aborts at once (no save, no traceback). A time limit (``exit_duration_mins``)
stops the same way and exits 0, as megatron's ``--exit-duration-in-mins`` does.

With several ranks, each rank's flag is all-reduced (max) every step, so that every rank stops
after the same step whichever of them got the signal. Ranks spawned by
:func:`mindspeed.launch.launch` ignore SIGINT themselves (a Ctrl-C in a terminal
reaches every process of the group): the launcher turns its own first SIGINT into
:data:`LAUNCHER_INTERRUPT` for them and a second one into SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Exit status of a run stopped by SIGTERM (128 + 15, as the shell reports it).
EXIT_SIGTERM = 143
#: Exit status of a run stopped by SIGINT (128 + 2).
EXIT_SIGINT = 130
#: The signal the launcher sends its ranks for a Ctrl-C it received (SIGINT itself is ignored there).
LAUNCHER_INTERRUPT = getattr(signal, "SIGUSR1", signal.SIGINT)

# Stop codes, ordered: the all-reduce keeps the strongest reason any rank has.
_NONE, _TIME, _SIGINT, _SIGTERM = 0, 1, 2, 3
_interrupt_from_launcher = [False]


@dataclass(frozen=True)
class StopRequest:
    """Why a run stops before its last step.

    Attributes:
        reason: ``"SIGTERM"``, ``"SIGINT"`` or ``"time limit"``.
        exit_code: the command's exit status (143, 130, 0).
    """

    reason: str
    exit_code: int


_REQUESTS = {
    _TIME: StopRequest("time limit", 0),
    _SIGINT: StopRequest("SIGINT", EXIT_SIGINT),
    _SIGTERM: StopRequest("SIGTERM", EXIT_SIGTERM),
}


def interrupts_come_from_launcher() -> None:
    """In a rank spawned by a launcher: ignore SIGINT; :data:`LAUNCHER_INTERRUPT` means Ctrl-C."""
    _interrupt_from_launcher[0] = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def resume_hint(where: str | None) -> str:
    """The end of every stop line: what the same command will do."""
    if where:
        return f"checkpoint {where}; run the same command to resume from it"
    return "no checkpoint was saved (checkpoint.save is not set)"


class Preemption:
    """Signal handlers and a time limit for a training loop (a context manager).

    Args:
        exit_duration_mins: stop after this many minutes (``None``: no limit).
        where: the save directory, named in the line a second Ctrl-C prints.

    Handlers are installed only in the main thread (elsewhere the object only keeps the time
    limit) and the previous ones are restored on exit.
    """

    def __init__(self, exit_duration_mins: float | None = None, where: str | None = None) -> None:
        self.exit_duration_mins = exit_duration_mins
        self.where = where
        self.start = time.monotonic()
        self._code = _NONE
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        self.start = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            interrupt = LAUNCHER_INTERRUPT if _interrupt_from_launcher[0] else signal.SIGINT
            for sig in (signal.SIGTERM, interrupt):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGTERM:
            self._code = _SIGTERM
            return
        if self._code == _SIGINT:  # the second Ctrl-C: stop now (forked writers die with this process)
            logger.error(
                "interrupted twice: stopped at once without saving; the same command resumes from the "
                "newest complete checkpoint%s",
                f" in {self.where}" if self.where else "",
            )
            os._exit(EXIT_SIGINT)
        self._code = max(self._code, _SIGINT)

    def requested(self) -> StopRequest | None:
        """This process's own stop request (signals and the time limit), without asking the other ranks."""
        code = self._code
        if code == _NONE and self.exit_duration_mins is not None:
            if time.monotonic() - self.start >= 60.0 * self.exit_duration_mins:
                code = _TIME
        return _REQUESTS.get(code)

    def agree(self, group: Any = None, device: Any = None) -> StopRequest | None:
        """The stop request of any rank of ``group`` (all ranks get the same answer); collective.

        Without an initialised torch.distributed, or in a group of one rank, this is :meth:`requested`
        (no collective: on gloo even a one-rank all-reduce hands the step over to another thread).
        """
        local = self.requested()
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return local
        codes = {request: code for code, request in _REQUESTS.items()}
        flag = torch.tensor([codes[local] if local is not None else _NONE], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return _REQUESTS.get(int(flag.item()))
