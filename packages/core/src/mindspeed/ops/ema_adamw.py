"""EMA-AdamW: one AdamW step that also updates an exponential moving average of the parameters.

MindSpeed's ``fused_ema_adamw`` optimizer (``npu_apply_fused_ema_adamw``): after the AdamW step
of :mod:`mindspeed.ops.adamw`, ::

    ema = ema_decay * ema + (1 - ema_decay) * p

in the same pass over the tensors, so diffusion training keeps its EMA weights without a second
sweep over memory. Implementations: the reference (the unfused AdamW reference, then the EMA
update, tensor by tensor), ``foreach`` and ``fused`` (the AdamW kernels of the same names, then
one multi-tensor lerp), and ``npu`` (the Ascend adapter's single kernel, in
:mod:`mindspeed.ops.backends.npu_basic`). :class:`FusedEMAAdamW` is the optimizer; its state adds
``ema`` to ``torch.optim.AdamW``'s keys, so the EMA weights travel in optimizer checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mindspeed.ops.adamw import (
    Tensors,
    _adamw_cases,
    _fused_adamw_available,
    adamw_foreach,
    adamw_fused,
    adamw_reference,
)
from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op, resolve_kernel


def ema_adamw_reference(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    ema_params: Tensors,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    ema_decay: float,
    maximize: bool = False,
) -> tuple[Tensors, Tensors, Tensors, Tensors]:
    """One AdamW step (:func:`~mindspeed.ops.adamw.adamw_reference`), then ``ema += (1 - ema_decay) (p - ema)``.

    Args:
        ema_params: the moving averages, updated in place with the updated parameters.
        ema_decay: weight of the old average.
        Others: as :func:`~mindspeed.ops.adamw.adamw_reference`.

    Returns:
        ``(params, exp_avgs, exp_avg_sqs, ema_params)``, the same lists.
    """
    adamw_reference(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
    )
    for param, ema in zip(params, ema_params, strict=True):
        ema.mul_(ema_decay).add_(param, alpha=1.0 - ema_decay)
    return params, exp_avgs, exp_avg_sqs, ema_params


def _ema_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = []
    for decay, case in zip((0.9, 0.999, 0.5, 0.0), _adamw_cases(dtype, device), strict=True):
        params = case.args[0]
        gen = torch.Generator().manual_seed(len(cases))
        ema = [p + 0.01 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]
        cases.append(
            Case(
                f"{case.name}, ema_decay {decay}",
                (*case.args[:4], ema, case.args[4]),
                {**case.kwargs, "ema_decay": decay},
                grad=False,
            )
        )
    return cases


def _ema_bench(dtype: torch.dtype, device: torch.device) -> Case:
    params = [torch.randn(1024, 1024, device=device, dtype=dtype) for _ in range(4)]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "ema_decay": 0.9999}
    return Case(
        "4 x 1024x1024",
        (params, [torch.randn_like(p) for p in params], *state, [p.clone() for p in params], 1),
        hyper,
        grad=False,
    )


register_op(
    OpSpec(
        name="ema_adamw",
        reference=ema_adamw_reference,
        doc="One AdamW step plus an EMA of the updated parameters, in place (MindSpeed's fused_ema_adamw)",
        cases=_ema_cases,
        bench_case=_ema_bench,
        dtypes=(torch.float32,),  # fp32 master weights, as the AdamW op
        tolerances={torch.float32: Tolerance(atol=1e-6, rtol=1e-5)},
    )
)


def _lerp_ema(params: Tensors, ema_params: Tensors, ema_decay: float) -> None:
    if params:
        torch._foreach_lerp_(ema_params, params, 1.0 - ema_decay)


@register_kernel("ema_adamw", "foreach", priority=5)
def ema_adamw_foreach(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    ema_params: Tensors,
    step: int,
    *,
    ema_decay: float,
    **hyper: Any,
) -> tuple[Tensors, Tensors, Tensors, Tensors]:
    """The multi-tensor AdamW step, then one multi-tensor lerp of the averages."""
    adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, step, **hyper)
    _lerp_ema(params, ema_params, ema_decay)
    return params, exp_avgs, exp_avg_sqs, ema_params


@register_kernel("ema_adamw", "fused", priority=10, available=_fused_adamw_available)
def ema_adamw_fused(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    ema_params: Tensors,
    step: int,
    *,
    ema_decay: float,
    **hyper: Any,
) -> tuple[Tensors, Tensors, Tensors, Tensors]:
    """torch's fused AdamW kernel, then one multi-tensor lerp of the averages."""
    adamw_fused(params, grads, exp_avgs, exp_avg_sqs, step, **hyper)
    _lerp_ema(params, ema_params, ema_decay)
    return params, exp_avgs, exp_avg_sqs, ema_params


class FusedEMAAdamW(torch.optim.Optimizer):
    """AdamW that also keeps an EMA of the parameters, through the registry's ``ema_adamw`` kernel.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay, maximize: as :class:`~mindspeed.ops.adamw.FusedAdamW`.
        ema_decay: weight of the old average per step (MindSpeed's ``--ema-decay``, e.g. 0.9999).
        impl: ``"auto"``, ``"reference"``, ``"foreach"``, ``"fused"`` or ``"npu"``.

    The average starts as a copy of the parameter at its first step. The state holds ``step``,
    ``exp_avg``, ``exp_avg_sq`` (``torch.optim.AdamW``'s keys) and ``ema``; :meth:`ema_weights`
    swaps the averages into the parameters for an export or an evaluation.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        ema_decay: float = 0.9999,
        maximize: bool = False,
        impl: str = "auto",
    ) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"FusedEMAAdamW: ema_decay must lie in [0, 1), got {ema_decay}")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"FusedEMAAdamW: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"FusedEMAAdamW: betas must lie in [0, 1), got {betas}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "maximize": maximize,
            "ema_decay": ema_decay,
        }
        super().__init__(params, defaults)
        self.kernel = resolve_kernel("ema_adamw", impl)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update every parameter that has a gradient, and its average; returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_step: dict[int, tuple[Tensors, ...]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("FusedEMAAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["ema"] = param.detach().clone(memory_format=torch.preserve_format)
                state["step"] = int(state["step"]) + 1
                lists = by_step.setdefault(state["step"], ([], [], [], [], []))
                values = (param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["ema"])
                for target, value in zip(lists, values):
                    target.append(value)
            beta1, beta2 = group["betas"]
            for step, (params, grads, exp_avgs, exp_avg_sqs, emas) in by_step.items():
                self.kernel(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    emas,
                    step,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    ema_decay=group["ema_decay"],
                    maximize=group["maximize"],
                )
        return loss

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Inside the block the parameters hold their averages (those never stepped keep their values)."""
        swapped = []
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    ema = self.state.get(param, {}).get("ema")
                    if ema is not None:
                        saved = param.detach().clone()
                        param.detach().copy_(ema)
                        swapped.append((param, saved))
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in swapped:
                    param.detach().copy_(saved)
