"""Optimizer and learning-rate schedule: megatron-core's own, built from their config sections.

:func:`build_optimizer` takes an :class:`~mindspeed_llm.training.sections.OptimizerConfig`, the model
chunks and the ``parallel`` section; :func:`build_scheduler` a
:class:`~mindspeed_llm.training.sections.SchedulerConfig`, the optimizer and a step count. A recipe's
``train`` section gives both (``TrainConfig.optimizer_config()`` / ``scheduler_config()``); the RL
actor fills them from its own recipe.

The optimizer is ``get_megatron_optimizer`` (AdamW or SGD; fp32 master weights for bf16 models;
the distributed optimizer when ``parallel.distributed_optimizer``), the schedule megatron's
``OptimizerParamScheduler`` counted in optimizer steps: linear warmup from
``lr_warmup_init`` to ``lr`` over ``lr_warmup_steps``, then ``cosine`` / ``linear`` decay to
``min_lr`` at ``lr_decay_steps`` (or ``constant`` / ``inverse-square-root``). As in megatron,
step ``k`` (counting from 1) trains with the learning rate of scheduler position ``k - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mindspeed.checkpointing import agree_any, is_finite
from mindspeed.ops.registry import resolve_kernel
from mindspeed_llm.training.sections import OptimizerConfig, ParallelConfig, SchedulerConfig


def build_optimizer(
    optim: OptimizerConfig,
    chunks: list[Any],
    parallel: ParallelConfig,
    kernels: Mapping[str, str] | None = None,
    groups: Any = None,
) -> Any:
    """megatron's optimizer over the parameters of ``chunks``.

    Args:
        optim: the optimizer section.
        chunks: this rank's model chunks (their ``TransformerConfig`` says whether the weights are
            bf16: the optimizer then keeps fp32 master weights).
        parallel: the layout's data-parallel options (distributed optimizer, parameter-gather overlap).
        kernels: the registry kernels, ``adapt(features=...)``'s ``report.kernels``: its ``adamw``
            choice runs the AdamW step (:func:`use_adamw_kernel`) unless ``optim.kernel`` names
            one; neither (or an ``adamw`` left on the reference) keeps megatron's default loop.
        groups: the process groups (``model.default_groups()``); ``None``: megatron reads its own.
    """
    import torch
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    bf16 = bool(_model_config(chunks[0]).bf16)
    optimizer_config = MegatronOptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        sgd_momentum=optim.sgd_momentum,
        clip_grad=optim.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=parallel.distributed_optimizer,
        overlap_param_gather=parallel.overlap_param_gather,
    )
    # Megatron's separate gloo groups are for host copies of a distributed optimizer's state
    # (dp-zero checkpoints we do not write); it refuses them with process groups given as values.
    optimizer = get_megatron_optimizer(
        optimizer_config, chunks, pg_collection=groups, use_gloo_process_groups=groups is None
    )
    impl = optim.kernel or (kernels.get("adamw") if kernels is not None else None)
    if optim.optimizer == "adam" and impl is not None:
        use_adamw_kernel(optimizer, impl)
    return optimizer


def _model_config(chunk: Any) -> Any:
    # The TransformerConfig of a (DDP / Float16Module wrapped) GPTModel chunk.
    while not hasattr(chunk, "config") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk.config


def use_adamw_kernel(optimizer: Any, impl: str) -> str | None:
    """Run megatron's AdamW step with the registry kernel ``impl``.

    Args:
        optimizer: what ``get_megatron_optimizer`` returned.
        impl: ``auto`` (the registry's best kernel on this device), ``fused``, ``foreach``;
            anything else (``reference``) keeps megatron's default loop.

    Returns:
        The kernel now used (None: megatron's default).

    Without Apex / Transformer Engine megatron builds ``torch.optim.AdamW`` with its default
    per-tensor loop. The registry's ``fused`` kernel is torch's single-kernel
    ``_fused_adamw_`` and its ``foreach`` kernel the multi-tensor one: torch's AdamW runs the
    same kernels when a parameter group says ``fused`` / ``foreach``, so the group flags are
    set and the optimizer object, its state and its checkpoints stay megatron's.
    """
    if impl == "auto":
        impl = resolve_kernel("adamw", "auto").name
    if impl not in ("fused", "foreach"):
        return None
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for torch_optimizer in inner:
        if torch_optimizer is None or type(torch_optimizer).__name__ not in ("AdamW", "Adam"):
            continue
        for group in torch_optimizer.param_groups:
            group["fused"], group["foreach"] = impl == "fused", impl == "foreach"
    return impl


def build_scheduler(sched: SchedulerConfig, optimizer: Any, steps: int) -> Any:
    """megatron's ``OptimizerParamScheduler`` for ``optimizer`` (anything with ``param_groups``).

    Args:
        sched: the schedule section.
        optimizer: what :func:`build_optimizer` returned.
        steps: the run's optimizer steps (the end of the decay unless ``sched.lr_decay_steps``).

    A resumed run whose section differs from the checkpoint's schedule is refused unless the
    recipe says which side wins (``checkpoint.override_scheduler`` / ``use_checkpoint_scheduler``,
    :func:`mindspeed_llm.training.checkpoint.load_checkpoint` applies it); by default the
    scheduler takes the section's values and only the position from a checkpoint.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        **_scheduler_args(sched, steps),
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def _scheduler_args(sched: SchedulerConfig, steps: int) -> dict[str, Any]:
    # A run of 0 steps (writing initial weights) still needs a valid schedule for its checkpoint.
    decay_steps = max(sched.lr_decay_steps or steps, sched.lr_warmup_steps + 1)
    return {
        "init_lr": sched.lr_warmup_init,
        "max_lr": sched.lr,
        "min_lr": sched.min_lr,
        "lr_warmup_steps": sched.lr_warmup_steps,
        "lr_decay_steps": decay_steps,
        "lr_decay_style": sched.lr_decay_style,
        "start_wd": sched.weight_decay,
        "end_wd": sched.weight_decay,
        "wd_incr_steps": decay_steps,
        "wd_incr_style": "constant",
    }


def scheduler_state(sched: SchedulerConfig, steps: int) -> dict[str, Any]:
    """What :func:`build_scheduler`'s scheduler records in a checkpoint (position 0), without building it."""
    return {**_scheduler_args(sched, steps), "num_steps": 0}


def schedule_settings(state: dict[str, Any], prefix: str = "train.", decay_key: str | None = None) -> dict[str, Any]:
    """The learning-rate settings a scheduler state records, keyed as a recipe spells them.

    Args:
        state: megatron's ``OptimizerParamScheduler.state_dict()`` (as a checkpoint holds it; the
            warmup's start ``init_lr`` where this trainer recorded it).
        prefix: the recipe section (``train.``; the RL actor's ``actor.``).
        decay_key: how the recipe sets the decay length (default ``PREFIXlr_decay_steps``).

    Settings that cannot change the learning rate are left out: the decay length and ``min_lr``
    of a ``constant`` schedule, the warmup's start without a warmup.
    """
    decay_key = decay_key or f"{prefix}lr_decay_steps"
    settings: dict[str, Any] = {
        f"{prefix}lr": state["max_lr"],
        f"{prefix}min_lr": state["min_lr"],
        f"{prefix}lr_warmup_init": state.get("init_lr"),
        f"{prefix}lr_warmup_steps": state["lr_warmup_steps"],
        f"{prefix}lr_decay_style": state["lr_decay_style"],
        decay_key: state["lr_decay_steps"],
    }
    if state.get("start_wd") is not None:
        start, end = state["start_wd"], state["end_wd"]
        settings[f"{prefix}weight_decay"] = (
            start if start == end else f"{start} to {end} ({state['wd_incr_style']}, {state['wd_incr_steps']} steps)"
        )
    if state["lr_decay_style"] == "constant":
        del settings[f"{prefix}min_lr"], settings[decay_key]
    if not state["lr_warmup_steps"] or state.get("init_lr") is None:
        del settings[f"{prefix}lr_warmup_init"]
    return settings


@dataclass(frozen=True)
class StepOutcome:
    """What :func:`guarded_step` did.

    Attributes:
        applied: the update reached the weights (the schedule should step).
        grad_norm: the global gradient norm before clipping (``None``: megatron's loss scaler
            found an overflow before it was computed).
        reason: why the update was refused: ``"loss"`` or ``"grad_norm"`` (non-finite, a
            divergence: counted against ``train.max_nonfinite_steps``), ``"loss_scale"`` (an
            fp16 overflow: the scaler lowered its scale, as megatron does); ``None`` when applied.
    """

    applied: bool
    grad_norm: float | None
    reason: str | None = None


def guarded_step(optimizer: Any, loss: float, device: Any = None, group: Any = None) -> StepOutcome:
    """megatron's ``optimizer.step()``, refused when the loss or the gradient norm is NaN/Inf on any rank.

    Args:
        optimizer: what :func:`build_optimizer` returned (one megatron optimizer or a chain).
        loss: the step's loss (the same on every rank).
        device: where the agreement flag lives (the accelerator's device).
        group: the ranks that must agree (default: the world).

    The steps of megatron's own ``step()`` (``ChainedOptimizer.step``), with the check between
    the gradient norm and the update: ``prepare_grads`` (gradients to the main copies; an fp16
    loss scaler unscales them and reports an overflow, and then the step is skipped exactly as
    megatron skips it), the global gradient norm (always computed: it is what is checked), one
    all-reduce of a "not finite" flag so that every rank skips the same step, then clipping by
    that norm and ``step_with_ready_grads``. A refused step leaves weights, main weights and
    optimizer state untouched; the caller does not step the schedule.
    """
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if optimizer.prepare_grads():
        return StepOutcome(False, None, "loss_scale")
    grad_norm = float(optimizer.get_grad_norm())
    bad_loss, bad_norm = not is_finite(loss), not is_finite(grad_norm)
    if agree_any(bad_loss or bad_norm, group, device):
        return StepOutcome(False, grad_norm, "loss" if bad_loss else "grad_norm")
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        params = inner.get_parameters()
        if params:
            # Looked up at call time: mindspeed.megatron patches this name (no CUDA type check).
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params,
                max_norm=inner.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    return StepOutcome(bool(optimizer.step_with_ready_grads()), grad_norm)


def current_lr(optimizer: Any) -> float:
    """The learning rate the next optimizer step uses (of the first parameter group)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr if lr is not None else optimizer.param_groups[0]["lr"])
