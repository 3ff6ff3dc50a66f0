"""The training loop of ``mindspeed-mm train``, shared by every MM model, on every rank.

Order of construction (as torchtitan): the task builds its model (loaded in fp32, frozen,
recomputed, sharded with FSDP2 over the data-parallel mesh), then the optimizer over the
sharded trainable parameters; resume from the newest complete checkpoint; train; export.
The task (:mod:`mindspeed_mm.trainer.task`) brings the microbatches and the loss; everything
else is here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger
from mindspeed.progress import StatusProgress
from mindspeed_llm.training.metrics import LOSS_CURVE, METRICS_FILE, MetricsLog, write_loss_curve
from mindspeed_mm.config import MMConfig
from mindspeed_mm.trainer import dit_task, vlm_task  # noqa: F401  (register the "dit" and "vlm" tasks)
from mindspeed_mm.trainer.checkpoint import load_checkpoint, newest_checkpoint, save_checkpoint
from mindspeed_mm.trainer.optim import build_optimizer, clip_gradients, export_weights, lr_at, set_lr
from mindspeed_mm.trainer.task import TASKS, TrainTask

logger = get_logger(__name__)


@dataclass
class TrainResult:
    """What a run did (rank 0's view).

    Attributes:
        records: the step records written to metrics.jsonl (``loss``, ``grad_norm``, ``lr``, ...).
        start_step: the step the run resumed after (0: a fresh run).
        checkpoint: the last checkpoint written (None: none).
        save_hf: the Hugging Face export (None: none).
        exports: every export written, by kind (``save_hf``, ``save_peft``).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    save_hf: str | None = None
    exports: dict[str, str] = field(default_factory=dict)


def train(config: MMConfig, task_name: str | None = None) -> TrainResult:
    """Train as ``config`` says on the ranks of the current process group; returns rank 0's :class:`TrainResult`.

    The task is ``task_name`` (default: the one the model directory calls for, :meth:`MMConfig.task`).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    config.check(world)
    t, ck = config.train, config.checkpoint
    torch.manual_seed(t.seed)
    task = TASKS.get(task_name or config.task())(config, world)
    optimizer = build_optimizer(t, task.model)
    trainable = [p for p in task.model.parameters() if p.requires_grad]
    result = TrainResult()
    resume_from = newest_checkpoint(ck.save) if ck.resume else None
    if resume_from is not None:
        result.start_step = int(load_checkpoint(resume_from, task.model, optimizer)["step"])
    log_dir = config.log_dir()
    metrics = MetricsLog(log_dir, result.start_step, enabled=rank == 0, tensorboard=config.logging.tensorboard)
    bar = StatusProgress("train", total=t.steps, disable=not (rank == 0 and config.logging.progress))
    try:
        _run_steps(config, rank, task, optimizer, trainable, metrics, bar, result)
    finally:
        metrics.close()
    with export_weights(optimizer):  # train.ema: the moving averages
        result.exports = task.export()
    result.save_hf = result.exports.get("save_hf")
    if rank == 0 and log_dir is not None and config.logging.loss_curve:
        write_loss_curve(log_dir / METRICS_FILE, log_dir / LOSS_CURVE)
    return result


def _run_steps(config: MMConfig, rank: int, task: TrainTask, optimizer: torch.optim.Optimizer,
               trainable: list[torch.Tensor], metrics: MetricsLog, bar: StatusProgress, result: TrainResult) -> None:
    t, ck = config.train, config.checkpoint
    with bar:
        if result.start_step:
            bar.update(advance=result.start_step, status="resumed")
        for step in range(result.start_step + 1, t.steps + 1):
            record = _train_step(config, step, rank, task, optimizer, trainable)
            metrics.write(record)
            result.records.append(record)
            status = f"loss {record['loss']:.4f} lr {record['lr']:.3g} gnorm {record['grad_norm']:.3f}"
            bar.update(status=status)
            if step % config.logging.interval == 0:
                logger.info("step %d/%d: %s %.0f tok/s", step, t.steps, status, record["tokens_per_s"] or 0.0)
            if ck.save and ((ck.interval and step % ck.interval == 0) or (step == t.steps and ck.save_at_end)):
                result.checkpoint = str(save_checkpoint(ck.save, step, task.model, optimizer, ck.keep_last))


def _train_step(config: MMConfig, step: int, rank: int, task: TrainTask, optimizer: torch.optim.Optimizer,
                trainable: list[torch.Tensor]) -> dict[str, Any]:
    t = config.train
    start = time.perf_counter()
    micro = task.microbatches(step, rank)
    totals = task.counts(micro)
    dist.all_reduce(totals)
    lr = lr_at(t, step)
    set_lr(optimizer, lr)
    reported = torch.zeros((), dtype=torch.float32, device=get_accelerator().device())
    for batch in micro:
        loss, share = task.loss(batch, totals)
        loss.backward()
        reported += share
    dist.all_reduce(reported)
    grad_norm = clip_gradients(trainable, t.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    tokens = task.step_tokens(totals)
    return {"kind": "train", "step": step, "loss": float(reported), "lr": lr, "grad_norm": grad_norm,
            "tokens": tokens, "step_time_s": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "skipped": False}
