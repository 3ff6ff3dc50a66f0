"""Deterministic training (MindSpeed's ``--npu-deterministic``), for whichever accelerator runs.

:func:`deterministic_mode` turns on ``torch.use_deterministic_algorithms`` (an op without a
deterministic implementation raises instead of running), the accelerator's own switches
(:meth:`~mindspeed.device.Accelerator.set_deterministic`: cuDNN's deterministic algorithms and
no autotuning on CUDA) and the environment its libraries read
(:meth:`~mindspeed.device.Accelerator.deterministic_env`: ``CUBLAS_WORKSPACE_CONFIG`` and a
fixed ``NCCL_ALGO`` on CUDA, ``HCCL_DETERMINISTIC`` on NPU), plus ``PYTHONHASHSEED`` for the
processes a run starts. Everything is put back on exit, so runs in one process do not leak
into each other. Variables a user already set are left as they are.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from mindspeed.device.accelerator import get_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)


def deterministic_env(seed: int | None = None) -> dict[str, str]:
    """The environment a deterministic run of this accelerator needs (for launchers to export)."""
    env = dict(get_accelerator().deterministic_env())
    if seed is not None:
        env["PYTHONHASHSEED"] = str(seed)
    return env


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True, seed: int | None = None) -> Iterator[dict[str, str]]:
    """Run the body deterministically (``enabled=False``: change nothing).

    Args:
        enabled: whether to switch anything.
        seed: exported as ``PYTHONHASHSEED`` (hash order of the processes the run starts).

    Yields:
        The environment variables this call set (those already set are not listed).
    """
    if not enabled:
        yield {}
        return
    acc = get_accelerator()
    was_on, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    added = {key: value for key, value in deterministic_env(seed).items() if key not in os.environ}
    os.environ.update(added)
    torch.use_deterministic_algorithms(True)
    previous = acc.set_deterministic(True)
    logger.info("deterministic mode on %s: deterministic algorithms, %s", acc.name, added or "no variable to set")
    try:
        yield added
    finally:
        acc.restore_deterministic(previous)
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
        for key in added:
            os.environ.pop(key, None)
