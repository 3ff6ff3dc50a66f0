"""A diverged step never reaches the weights or a checkpoint: the agreed skip and the save-time check.

The trainers (LLM, MM, the GRPO actor) skip an optimizer step whose loss or gradient norm is
NaN/Inf on any rank (:func:`agree_any`: every rank skips the same step) and count the skips in
a :class:`SkipCounter`, which stops the run after ``limit`` in a row with one line. Before a
checkpoint is written, :func:`first_nonfinite_everywhere` looks at every tensor it would hold
(this rank's parameters and optimizer state: ``torch.isfinite(t).all()`` per tensor, one host
sync) and agrees over the ranks; a non-finite one refuses the save with :class:`NonFiniteState`
before anything is written, so the previous complete checkpoint stays the resume point.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteState(RuntimeError):
    """A checkpoint was refused because the state it would hold has NaN/Inf values; the message is one line."""


def _several(group: Any) -> bool:
    # No collective in a group of one: on gloo even a one-rank all-reduce costs a thread hand-off.
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def agree_any(flag: bool, group: Any = None, device: Any = None) -> bool:
    """``True`` on every rank of ``group`` (default: the world) when ``flag`` is true on any of them; collective."""
    if not _several(group):
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def is_finite(value: float | None) -> bool:
    """A number that is neither NaN nor infinite (``None``, a norm that was not computed, counts as finite)."""
    return value is None or math.isfinite(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def first_nonfinite(named: Iterable[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor of ``named`` holding NaN/Inf on this rank (no collective).

    One ``isfinite().all()`` per tensor, reduced on its device with one host sync per device;
    only when something is not finite are the names looked at one by one.
    """
    tensors = [
        (name, _local(t)) for name, t in named if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
    ]
    # A tensor whose storage is released holds nothing to check (reuse_fp32_param frees the fp32
    # masters between steps: their bf16 weights and remainders are the state then); reading it crashes.
    tensors = [(name, t) for name, t in tensors if t.untyped_storage().nbytes() > 0]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return None
    return next(name for name, t in tensors if not bool(torch.isfinite(t).all()))


def first_nonfinite_everywhere(named: Iterable[tuple[str, Any]], group: Any = None, device: Any = None) -> str | None:
    """:func:`first_nonfinite` over every rank of ``group`` (``"name (rank r)"``), the same on every rank; collective."""
    local = first_nonfinite(named)
    if not agree_any(local is not None, group, device):
        return None
    if not _several(group):
        return local
    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, local, group=group)
    rank, name = next((r, n) for r, n in enumerate(names) if n is not None)
    return f"{name} (rank {rank})"


def refused_save(where: Any, bad: str, previous: Any, lr_key: str = "train.lr") -> str:
    """The one line of a save refused for non-finite state: what, and which checkpoint stays the resume point."""
    resume = (
        f"the newest complete checkpoint {previous} stays the resume point"
        if previous is not None
        else "no complete checkpoint was written before it"
    )
    return (
        f"checkpoint {where} not written: {bad} holds NaN/Inf values (the run diverged); {resume}: "
        f"lower {lr_key} (or raise the precision) and run the same command"
    )


@dataclass
class SkipCounter:
    """Steps skipped for a non-finite loss or gradient norm: in all, and in a row at the end.

    Args:
        limit: stop after this many skips in a row (``train.max_nonfinite_steps``; at least 1).
        key: the setting that holds ``limit``, named in the lines.
        lr_key: the learning-rate setting the stop line suggests lowering.
        unit: what is skipped (``step``; the GRPO actor's ``actor update``).
    """

    limit: int
    key: str = "train.max_nonfinite_steps"
    lr_key: str = "train.lr"
    unit: str = "step"
    skipped: int = 0
    streak: int = 0

    def record(self, applied: bool, diverged: bool) -> None:
        """Count one step: ``applied`` (its update reached the weights) and ``diverged`` (refused for a
        non-finite loss or gradient norm: the streak grows; anything else ends it)."""
        if not applied:
            self.skipped += 1
        self.streak = self.streak + 1 if diverged else 0

    def exhausted(self) -> bool:
        """Whether the skips in a row reached the limit."""
        return self.streak >= max(self.limit, 1)

    def skip_line(self, step: int, loss: float, grad_norm: float | None) -> str:
        """The warning of one skipped step (the value that is not finite first)."""
        what = f"loss is {loss}" if not is_finite(loss) else f"gradient norm is {grad_norm} (loss {loss:.4f})"
        return (
            f"{self.unit} {step}: {what}; {self.unit} skipped: no update, the learning-rate schedule does not "
            f"advance ({self.streak} in a row, {self.key}={self.limit})"
        )

    def stop_line(self, step: int, lr: float, resume: str) -> str:
        """Why the run stops: the skips in a row, the last step, what to change and where it resumes."""
        return (
            f"{self.streak} consecutive {self.unit}s with a non-finite loss or gradient norm ({self.key}="
            f"{self.limit}), the last at {self.unit} {step}: the run diverged; lower {self.lr_key} (now {lr:g}) "
            f"and run the same command: {resume}"
        )
