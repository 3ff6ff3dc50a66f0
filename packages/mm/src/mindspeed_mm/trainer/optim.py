"""AdamW (or EMA-AdamW) through the core kernel registry, the learning-rate schedule, and gradient clipping over shards."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from mindspeed.log import get_logger
from mindspeed.ops.adamw import FusedAdamW
from mindspeed.ops.ema_adamw import FusedEMAAdamW
from mindspeed_mm.config import MMTrainConfig

logger = get_logger(__name__)


def build_optimizer(train: MMTrainConfig, model: torch.nn.Module) -> FusedAdamW | FusedEMAAdamW:
    """AdamW over the trainable (sharded) parameters; biases and norms (1-D tensors) get no weight decay.

    Raises:
        ValueError: nothing is trainable.
    """
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("every parameter is frozen (model.freeze); leave at least one part trainable")
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    hyper = {
        "lr": lr_at(train, 1),
        "betas": (train.adam_beta1, train.adam_beta2),
        "eps": train.adam_eps,
        "impl": train.optimizer_impl,
    }
    groups = [g for g in groups if g["params"]]
    if train.ema > 0:
        optimizer = FusedEMAAdamW(groups, ema_decay=train.ema, **hyper)
        logger.info("optimizer: EMA-AdamW (ema decay %g), kernel %s", train.ema, optimizer.kernel.name)
    else:
        optimizer = FusedAdamW(groups, **hyper)
        logger.info("optimizer: AdamW, kernel %s", optimizer.kernel.name)
    return optimizer


def lr_at(train: MMTrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (counting from 1).

    Linear warmup reaches ``lr`` at step ``lr_warmup_steps``; the step after it trains with
    ``lr``, and ``linear`` / ``cosine`` decay from there would reach ``min_lr`` one step after
    ``steps`` (as megatron, whose step ``k`` uses the schedule's position ``k - 1``), so no step
    is wasted at the end; ``constant`` keeps ``lr``.
    """
    warmup = train.lr_warmup_steps
    if step <= warmup:
        return train.lr * step / warmup
    if train.lr_decay_style == "constant" or train.steps <= warmup:
        return train.lr
    progress = min(1.0, (step - 1 - warmup) / (train.steps - warmup))
    if train.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * factor


#: The ``train`` fields the learning rate and weight decay follow (what a checkpoint records).
SCHEDULE_FIELDS = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "steps", "weight_decay")


def schedule_of(train: MMTrainConfig) -> dict[str, Any]:
    """The schedule fields of ``train`` (a checkpoint's ``schedule.json``)."""
    return {name: getattr(train, name) for name in SCHEDULE_FIELDS}


def schedule_settings(schedule: dict[str, Any]) -> dict[str, Any]:
    """A schedule's fields keyed as the recipe spells them, without those that cannot change the learning
    rate (the decay's end and ``min_lr`` of a ``constant`` schedule), for the resume check."""
    settings = {f"train.{name}": schedule[name] for name in SCHEDULE_FIELDS if name in schedule}
    if schedule.get("lr_decay_style") == "constant":
        settings.pop("train.min_lr", None)
        settings.pop("train.steps", None)
    if "train.steps" in settings:
        settings["train.steps (the decay's end)"] = settings.pop("train.steps")
    return settings


def set_weight_decay(optimizer: torch.optim.Optimizer, weight_decay: float) -> None:
    """Set the weight decay of the groups that decay (matrices; biases and norms keep none), as
    :func:`build_optimizer` does; a resume sets the one of the schedule it follows."""
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay if any(p.ndim >= 2 for p in group["params"]) else 0.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(parameters: list[torch.Tensor], max_norm: float) -> float:
    """The global gradient norm over all shards and ranks; gradients are scaled to ``max_norm`` if above (0: never).

    A NaN/Inf norm is returned without touching the gradients: the step is skipped (``trainer.loop``).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total: Any = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # DTensor: the norm of the whole (sharded) gradient
        total = total.full_tensor()
    norm = float(total)
    if max_norm > 0 and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return norm


def export_weights(optimizer: torch.optim.Optimizer, ema: bool = True) -> contextlib.AbstractContextManager:
    """What the exports write: inside the block the parameters hold their moving averages under
    ``train.ema`` (unless ``ema`` is false: ``checkpoint.export_ema``), else their own values."""
    if ema and isinstance(optimizer, FusedEMAAdamW):
        return optimizer.ema_weights()
    return contextlib.nullcontext()
