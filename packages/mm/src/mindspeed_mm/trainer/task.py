"""What a kind of model brings to the shared FSDP2 trainer: its sharded model, its microbatches, its loss.

The trainer (:mod:`mindspeed_mm.trainer.loop`) owns everything else: the optimizer, the
schedule, gradient accumulation, clipping, checkpoints, resume, metrics, the progress bar and
the export. A task for another kind of model implements :class:`TrainTask`, registers it in
:data:`TASKS` and gets one line in :data:`TASK_MODULES`, the manifest (as the model families'
:mod:`mindspeed_mm.models.manifest`): a task's module is imported when its name is first looked up,
never for its side effect, so importing the trainer loads no task.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from mindspeed_mm.models.manifest import ManifestRegistry


class TrainTask(Protocol):
    """One kind of training.

    Attributes:
        model: the model, already sharded with FSDP2 (:func:`mindspeed_mm.trainer.fsdp.apply_fsdp`).
        source: the Hugging Face directory the model came from (its non-weight files go into the export).
    """

    model: torch.nn.Module
    source: Path

    def microbatches(self, step: int, rank: int) -> list[Any]:
        """This rank's microbatches of optimizer step ``step`` (from 1); a function of the step alone."""

    def counts(self, microbatches: list[Any]) -> torch.Tensor:
        """This rank's float64 counts over ``microbatches`` (the trainer sums them over ranks before the losses)."""

    def loss(self, microbatch: Any, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(backward_loss, reported_share)`` of one microbatch: the reported loss of the step is the sum of
        the shares over microbatches and ranks; FSDP2 averages gradients over ranks."""

    def step_tokens(self, totals: torch.Tensor) -> int:
        """Tokens the step processed over all ranks (for tokens/s)."""

    # Optional: ``finish_gradients(totals)``, called after the step's backward passes and before
    # clipping, to drop gradients one rank running the whole step would not have (the VLM task's).

    def export(self) -> dict[str, str]:
        """Write the exports the recipe asks for at the end (a collective); rank 0 returns ``{kind: path}``."""


class ValidatedTask(TrainTask, Protocol):
    """A task that scores ``data.valid_files`` for the validation loss (:mod:`mindspeed_mm.trainer.validation`)."""

    def valid_microbatches(self, rank: int) -> list[Any]:
        """This rank's validation microbatches; every rank gets as many (the forwards are collectives)."""

    def valid_counts(self, microbatches: list[Any]) -> torch.Tensor:
        """This rank's float64 counts over its validation microbatches (summed over ranks before the losses)."""

    def valid_loss(self, microbatch: Any, totals: torch.Tensor) -> torch.Tensor:
        """This rank's share of the validation loss (run without gradients): the loss is the sum of the
        shares over microbatches and ranks."""


#: task name (``MMConfig.task()``) -> the module that registers it.
TASK_MODULES = {"vlm": "mindspeed_mm.trainer.vlm_task", "dit": "mindspeed_mm.trainer.dit_task"}
#: task name -> ``(config, world_size) -> TrainTask``; a lookup imports the task's module first.
TASKS: ManifestRegistry[Callable[[Any, int], TrainTask]] = ManifestRegistry("training task", TASK_MODULES)
