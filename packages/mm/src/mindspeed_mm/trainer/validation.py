"""The validation loss of ``mindspeed-mm train``: ``data.valid_files`` scored every ``eval.interval`` steps and at the end.

Every rank forwards its validation microbatches (:class:`~mindspeed_mm.trainer.task.ValidatedTask`)
without gradients and with the model in eval mode (no dropout, LoRA's included); the counts are
summed over ranks first, as in a training step, then the loss shares. The record is the LLM
trainer's (``{"kind": "eval", "step", "loss", "tokens"}``), so ``metrics.jsonl``, TensorBoard
(``eval/loss``) and ``loss.png`` show it as they show the LLM suite's validation loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed_mm.config import MMConfig
from mindspeed_mm.trainer.task import ValidatedTask


def evaluation_due(config: MMConfig, step: int) -> bool:
    """Whether step ``step`` ends with a validation loss (``eval.interval``, ``eval.at_end``)."""
    e = config.eval
    if not config.data.valid_files:
        return False
    return bool((e.interval and step % e.interval == 0) or (e.at_end and step == config.train.steps))


def validation_loss(task: ValidatedTask, step: int) -> dict[str, Any]:
    """The validation record of step ``step`` (a collective: every rank calls it)."""
    several = dist.get_world_size() > 1
    microbatches = task.valid_microbatches(dist.get_rank())
    totals = task.valid_counts(microbatches)
    if several:
        dist.all_reduce(totals)
    total = torch.zeros((), dtype=torch.float32, device=get_accelerator().device())
    task.model.eval()
    try:
        with torch.no_grad():
            for microbatch in microbatches:
                total += task.valid_loss(microbatch, totals)
    finally:
        task.model.train()
    if several:
        dist.all_reduce(total)
    return {"kind": "eval", "step": step, "loss": float(total), "tokens": int(totals[0])}
