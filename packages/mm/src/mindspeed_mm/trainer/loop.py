"""The training loop of ``mindspeed-mm train``, shared by every MM model, on every rank.

Order of construction (as torchtitan): the task builds its model (loaded in fp32, frozen,
recomputed, sharded with FSDP2 over the data-parallel mesh), then the optimizer over the
sharded trainable parameters; resume from the newest complete checkpoint; train; export.
The task (:mod:`mindspeed_mm.trainer.task`) brings the microbatches and the loss; everything
else is here. SIGTERM, the first Ctrl-C and ``train.exit_duration_mins`` stop the run after a
step with a checkpoint and one line (:class:`~mindspeed.checkpointing.Preemption`, as the LLM
trainer; docs/reliability.md). A step whose loss or gradient norm is NaN/Inf on any rank is
skipped before the optimizer applies it (the learning-rate schedule, a function of the applied
steps, does not advance); ``train.max_nonfinite_steps`` of them in a row, or a checkpoint whose
state holds NaN/Inf (refused before anything is written), stop the run with exit status 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.checkpointing import (
    NonFiniteState,
    Preemption,
    SkipCounter,
    StopRequest,
    agree_any,
    fault_armed,
    fault_point,
    is_finite,
    plant_nan,
    resolve_schedule,
    resume_hint,
    step_of,
)
from mindspeed.config import to_dict
from mindspeed.device import deterministic_mode, get_accelerator, retain_freed_host_memory
from mindspeed.log import get_logger
from mindspeed.metrics.log import LOSS_CURVE, METRICS_FILE, write_loss_curve
from mindspeed.metrics.trackers import Tracking, open_tracking
from mindspeed.progress import StatusProgress
from mindspeed_mm.config import MMConfig, MMTrainConfig
from mindspeed_mm.trainer.checkpoint import (
    LAYOUT,
    find_resume_checkpoint,
    load_checkpoint,
    read_schedule,
    save_checkpoint,
    step_dir,
)
from mindspeed_mm.trainer.optim import (
    SCHEDULE_FIELDS,
    build_optimizer,
    clip_gradients,
    export_weights,
    lr_at,
    schedule_of,
    schedule_settings,
    set_lr,
    set_weight_decay,
)
from mindspeed_mm.trainer.task import TASKS, TrainTask
from mindspeed_mm.trainer.validation import evaluation_due, validation_loss

logger = get_logger(__name__)


@dataclass
class TrainResult:
    """What a run did (rank 0's view).

    Attributes:
        records: the step records written to metrics.jsonl (``loss``, ``grad_norm``, ``lr``, ...).
        evals: the validation records (``kind: eval``, ``step``, ``loss``, ``tokens``; ``data.valid_files``).
        start_step: the step the run resumed after (0: a fresh run).
        checkpoint: the last checkpoint written (None: none).
        save_hf: the Hugging Face export (None: none).
        exports: every export written, by kind (``save_hf``, ``save_peft``).
        preempted: ``"SIGTERM"``, ``"SIGINT"`` or ``"time limit"`` when the run stopped for one
            (after saving; no export then).
        exit_code: the exit status the command should end with (0; 143 / 130 after a signal; 1
            when ``stopped``).
        stopped: why the run stopped on an error, one line (no export then): too many non-finite
            steps in a row, or a checkpoint refused for non-finite state; ``None``: it did not.
        skipped_steps: steps whose update was refused (a non-finite loss or gradient norm).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    start_step: int = 0
    checkpoint: str | None = None
    save_hf: str | None = None
    exports: dict[str, str] = field(default_factory=dict)
    preempted: str | None = None
    exit_code: int = 0
    stopped: str | None = None
    skipped_steps: int = 0


def train(config: MMConfig, task_name: str | None = None) -> TrainResult:
    """Train as ``config`` says on the ranks of the current process group; returns rank 0's :class:`TrainResult`.

    The task is ``task_name`` (default: the one the model directory calls for, :meth:`MMConfig.task`).
    """
    config.check(dist.get_world_size())
    # SIGTERM / Ctrl-C from here on end the run after a step and a checkpoint, not with a traceback.
    with (
        deterministic_mode(config.train.deterministic, config.train.seed),
        retain_freed_host_memory(config.train.retain_host_memory),
        Preemption(config.train.exit_duration_mins, config.checkpoint.save) as preemption,
    ):
        return _train(config, task_name, preemption)


def _train(config: MMConfig, task_name: str | None, preemption: Preemption) -> TrainResult:
    world, rank = dist.get_world_size(), dist.get_rank()
    t, ck = config.train, config.checkpoint
    resume_from = find_resume_checkpoint(ck.save, ck.resume)  # before the model: a save directory error is quick
    schedule = _resumed_schedule(config, resume_from, rank)  # the train settings the learning rate follows
    torch.manual_seed(t.seed)
    task = TASKS.get(task_name or config.task())(config, world)
    optimizer = build_optimizer(t, task.model)
    trainable = [p for p in task.model.parameters() if p.requires_grad]
    result = TrainResult()
    skips = SkipCounter(t.max_nonfinite_steps)
    if resume_from is not None:
        state = load_checkpoint(resume_from, task.model, optimizer, task.source, config.lora.enabled)
        result.start_step = int(state["step"])
        skips.skipped, skips.streak = int(state.get("skipped_steps", 0)), int(state.get("nonfinite_streak", 0))
        # The weight decay came back with the optimizer's state: the schedule's the run follows wins.
        set_weight_decay(optimizer, schedule.weight_decay)
    log_dir = config.log_dir()
    bar = StatusProgress(
        "train", total=t.steps, completed=result.start_step, disable=not (rank == 0 and config.logging.progress)
    )
    # The trackers of logging.trackers on rank 0 (metrics.jsonl, TensorBoard, ...), the recipe as the run's config.
    metrics = open_tracking(
        config.logging, log_dir, result.start_step, rank == 0, to_dict(config) if rank == 0 else None
    )
    try:
        _run_steps(config, rank, task, optimizer, trainable, metrics, bar, result, preemption, schedule, skips)
    except NonFiniteState as err:  # a save refused (interval, preemption or last step)
        result.stopped = str(err)
    finally:
        metrics.close()
    result.skipped_steps = skips.skipped
    if result.stopped is not None:
        result.exit_code = 1
    if result.preempted is None and result.stopped is None:  # a stopped run is not finished: no export
        with export_weights(optimizer, config.checkpoint.export_ema):  # train.ema: the moving averages
            result.exports = task.export()
    result.save_hf = result.exports.get("save_hf")
    if rank == 0 and log_dir is not None and config.logging.loss_curve and metrics.path is not None:
        write_loss_curve(log_dir / METRICS_FILE, log_dir / LOSS_CURVE)
    return result


def _resumed_schedule(config: MMConfig, resume_from: Path | None, rank: int) -> MMTrainConfig:
    """The ``train`` settings the learning rate and weight decay follow: the checkpoint's when it wins.

    Raises:
        ConfigError: they differ and neither ``checkpoint.override_scheduler`` nor
            ``checkpoint.use_checkpoint_scheduler`` says which wins (one line listing each difference).
    """
    t, ck = config.train, config.checkpoint
    saved = read_schedule(resume_from) if resume_from is not None else None
    if saved is None:
        return t
    winner = resolve_schedule(
        schedule_settings(saved),
        schedule_settings(schedule_of(t)),
        resume_from,
        step_of(resume_from, LAYOUT) or 0,
        override=ck.override_scheduler,
        use_checkpoint=ck.use_checkpoint_scheduler,
        announce=rank == 0,
    )
    if winner != "checkpoint":
        return t
    return replace(t, **{name: value for name, value in saved.items() if name in SCHEDULE_FIELDS})


def _run_steps(
    config: MMConfig,
    rank: int,
    task: TrainTask,
    optimizer: torch.optim.Optimizer,
    trainable: list[torch.Tensor],
    metrics: Tracking,
    bar: StatusProgress,
    result: TrainResult,
    preemption: Preemption,
    schedule: MMTrainConfig,
    skips: SkipCounter,
) -> None:
    t, ck = config.train, config.checkpoint
    # What the checkpoints record as their learning-rate schedule (the one this run follows).
    save = partial(save_checkpoint, schedule=schedule_of(schedule))
    saved = result.start_step or None  # the step of the newest checkpoint in ck.save (the resumed one)

    def counters() -> dict[str, int]:
        return {"skipped_steps": skips.skipped, "nonfinite_streak": skips.streak}

    with bar:
        for step in range(result.start_step + 1, t.steps + 1):
            stop = preemption.agree(device=get_accelerator().device())
            if stop is not None:
                _preempt(config, step - 1, saved, stop, task, optimizer, result, save, counters())
                return
            record = _train_step(config, step, rank, task, optimizer, trainable, skips, schedule)
            metrics.write(record)
            result.records.append(record)
            fields = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.3g}", f"gnorm {record['grad_norm']:.3f}"]
            status = " ".join(fields)
            bar.update(status=fields)
            if step % config.logging.interval == 0:
                logger.info("step %d/%d: %s %.0f tok/s", step, t.steps, status, record["tokens_per_s"] or 0.0)
            if skips.exhausted():  # no save: the run stops where its last complete checkpoint is
                where = f"it resumes from {step_dir(ck.save, saved)}" if ck.save and saved else "it starts from step 1"
                result.stopped = skips.stop_line(step, t.lr, where)
                return
            if evaluation_due(config, step):  # before the save: a resumed run keeps this record
                evaluated = validation_loss(task, step)
                metrics.write(evaluated)
                result.evals.append(evaluated)
                logger.info("step %d/%d: validation loss %.4f", step, t.steps, evaluated["loss"])
            fault_point("train.step_end", step)
            if ck.save and ((ck.interval and step % ck.interval == 0) or (step == t.steps and ck.save_at_end)):
                result.checkpoint = str(
                    save(
                        ck.save,
                        step,
                        task.model,
                        optimizer,
                        ck.keep_last,
                        task.source,
                        config.lora.enabled,
                        counters=counters(),
                    )
                )
                saved = step


def _preempt(
    config: MMConfig,
    step: int,
    saved: int | None,
    stop: StopRequest,
    task: TrainTask,
    optimizer: torch.optim.Optimizer,
    result: TrainResult,
    save: Callable[..., Path],
    counters: dict[str, int],
) -> None:
    """Stop for a signal or the time limit: save step ``step`` unless it is saved, and say where."""
    ck = config.checkpoint
    if ck.save and step > 0 and saved != step:
        result.checkpoint = str(
            save(
                ck.save, step, task.model, optimizer, ck.keep_last, task.source, config.lora.enabled, counters=counters
            )
        )
        saved = step
    where = str(step_dir(ck.save, saved)) if ck.save and saved is not None else None
    result.preempted, result.exit_code = stop.reason, stop.exit_code
    cause = (
        f"the time limit (train.exit_duration_mins={config.train.exit_duration_mins})"
        if stop.reason == "time limit"
        else stop.reason
    )
    if dist.get_rank() == 0:
        logger.warning("stopped by %s after step %d of %d: %s", cause, step, config.train.steps, resume_hint(where))


def _train_step(
    config: MMConfig,
    step: int,
    rank: int,
    task: TrainTask,
    optimizer: torch.optim.Optimizer,
    trainable: list[torch.Tensor],
    skips: SkipCounter,
    schedule: MMTrainConfig | None = None,
) -> dict[str, Any]:
    t = config.train
    start = time.perf_counter()
    micro = task.microbatches(step, rank)
    totals = task.counts(micro)
    several = dist.get_world_size() > 1  # one rank: nothing to sum (a gloo call costs a thread hand-off)
    if several:
        dist.all_reduce(totals)
    lr = lr_at(schedule or t, step - skips.skipped)  # the schedule counts applied steps (as megatron's)
    set_lr(optimizer, lr)
    reported = torch.zeros((), dtype=torch.float32, device=get_accelerator().device())
    for batch in micro:
        loss, share = task.loss(batch, totals)
        loss.backward()
        reported += share
    if several:
        dist.all_reduce(reported)
    finish = getattr(task, "finish_gradients", None)
    if finish is not None:
        finish(totals)
    if fault_armed("train.grad_nan", step) and rank == 0:
        plant_nan(next(p.grad for p in trainable if p.grad is not None))
    grad_norm = clip_gradients(trainable, t.clip_grad)
    loss = float(reported)
    # NaN/Inf on any rank: every rank skips the update (the gradients are dropped below).
    skip = agree_any(not (is_finite(loss) and is_finite(grad_norm)), device=reported.device)
    if not skip:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    skips.record(not skip, skip)
    if skip and rank == 0:
        logger.warning(skips.skip_line(step, loss, grad_norm))
    seconds = time.perf_counter() - start
    tokens = task.step_tokens(totals)
    return {
        "kind": "train",
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "step_time_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "skipped": skip,
        "skipped_steps": skips.skipped,
    }
