"""Fault points: named places where a test can have a run killed with SIGKILL, deterministically.

The reliability tests set ``MINDSPEED_FAULT=<point>@<step>`` (for example
``save.renamed@4``); the process that reaches that point at that step kills itself with
SIGKILL, exactly as ``kill -9`` from outside would. ``<point>@<step>=SIGTERM`` (or ``SIGINT``,
``SIGINTx2``) sends that signal instead (twice for ``x2``), as a scheduler or a Ctrl-C would. Without the variable a fault point is a
no-op (one dictionary lookup). Points: ``train.step_start``, ``train.step_end``,
``save.start``, ``save.written``, ``save.renamed``, ``save.tracker`` (the trainer), ``rl.step_end``
(the RL driver; ``rl.kill_actor`` and ``rl.kill_buffer`` there SIGKILL the actor worker of rank 0
or the replay buffer, another process, at the end of the step: :func:`fault_armed`) and ``save.writer``: a forked checkpoint writer kills its trainer and then
keeps writing for a while, so that a writer that does not die with its trainer is caught.

``save.write@<step>=ENOSPC`` (or ``=EDQUOT``) makes the save of that step run out of space where
it writes: in megatron's forked checkpoint writers every file they open fails its first write
with that ``OSError`` (as a full file system would), elsewhere (the multimodal trainer, the RL
driver, an export) the fault point itself raises it.

Damage points (:func:`fault_armed`) plant a value instead of killing: ``train.grad_nan`` (after
the backward of that step, a NaN in a gradient: the loss stays finite, the gradient norm does
not) and ``save.param_nan`` (before that step's save, a NaN in a parameter: what a diverged
update that escaped the step's check, or a bit flip, would leave). ``<point>@<step>+`` arms a
damage point at that step and every later one.

``MINDSPEED_FAULT_RANK=<rank>`` arms the point in the processes of that global rank only (``RANK``;
its forked writers included). A fault fires on the first attempt of a run only: a group restarted
by ``--max-restarts`` (ours or torchrun's: ``TORCHELASTIC_RESTART_COUNT`` above 0) runs the same
steps again without it, as a restart after a real crash would.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import time
from typing import Any

#: The environment variable that arms a fault point.
FAULT_ENV = "MINDSPEED_FAULT"
#: The environment variable that limits the fault to the processes of one global rank.
FAULT_RANK_ENV = "MINDSPEED_FAULT_RANK"
_step: list[int] = [-1]  # the step of the save in progress, for the forked writers


def _here() -> bool:
    """Whether an armed fault fires in this process: its rank, and the first attempt of the run."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank = os.environ.get(FAULT_RANK_ENV)
    return rank is None or os.environ.get("RANK", "0") == rank


def _armed(name: str, step: int) -> bool:
    return os.environ.get(FAULT_ENV, "").split("=")[0] == f"{name}@{step}" and _here()


_ERRNOS = {"ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT}


def _no_space(action: str) -> OSError:
    code = _ERRNOS[action]
    return OSError(code, os.strerror(code))


def fault_point(name: str, step: int) -> None:
    """Kill this process with SIGKILL (or send it the signal named) if ``MINDSPEED_FAULT`` is ``name@step[=SIGNAL]``."""
    if name.startswith("save."):  # the training points of later steps leave it: an async save writes on
        _step[0] = step
    if FAULT_ENV in os.environ and _armed(name, step):
        action = os.environ[FAULT_ENV].partition("=")[2] or "SIGKILL"
        if action in _ERRNOS:
            raise _no_space(action)
        sig, _, times = action.partition("x")
        for _ in range(int(times or 1)):
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(0.2)  # one signal at a time: Python runs a handler once per pending signal


def child_fault(name: str) -> None:
    """In a forked child: kill the parent if ``MINDSPEED_FAULT`` is ``name@<step of the save>``, then linger."""
    if FAULT_ENV in os.environ and _armed(name, _step[0]):
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(20.0)  # a writer that survives its trainer is still here when the test looks


class _FullFile:
    """A file whose writes fail as on a full file system (everything else is the real file's)."""

    def __init__(self, file: Any, action: str) -> None:
        self._file, self._action = file, action

    def write(self, data: Any) -> int:
        raise _no_space(self._action)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def child_write_fault(name: str = "save.write") -> None:
    """In a forked checkpoint writer: if ``MINDSPEED_FAULT`` is ``name@<step of the save>=ENOSPC`` (or
    ``EDQUOT``), every file this process opens for writing from now on fails its writes with that error."""
    if FAULT_ENV not in os.environ or not _armed(name, _step[0]):
        return
    action = os.environ[FAULT_ENV].partition("=")[2]
    if action not in _ERRNOS:
        return
    real_open = builtins.open

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        return _FullFile(handle, action) if any(c in mode for c in "wax+") else handle

    builtins.open = full_open  # this process is a writer forked for one save: it exits after it


def fault_armed(name: str, step: int) -> bool:
    """Whether ``MINDSPEED_FAULT`` arms the damage point ``name`` at ``step`` (``name@step``, or ``name@K+`` for K <= step)."""
    if FAULT_ENV not in os.environ:
        return False
    point, _, at = os.environ[FAULT_ENV].partition("=")[0].partition("@")
    if point != name or not at.rstrip("+").isdigit() or not _here():
        return False
    return step >= int(at[:-1]) if at.endswith("+") else step == int(at)


def plant_nan(tensor: object) -> None:
    """Write a NaN into the first element of ``tensor`` (this rank's shard of a DTensor), in place."""
    import torch

    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if local.numel():
        with torch.no_grad():
            local.view(-1)[0] = float("nan")
