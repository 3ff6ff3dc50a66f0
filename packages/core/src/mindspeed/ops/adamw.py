"""AdamW: the functional step ``adamw`` and the optimizer :class:`FusedAdamW` that calls it.

One step over lists of tensors, in place, with decoupled weight decay and bias correction::

    p *= 1 - lr * weight_decay
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    p -= lr / (1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)

``step`` is the step number after increment (1 on the first step). Implementations: the
per-tensor reference, ``foreach`` (torch's multi-tensor ops) and ``fused`` (torch's
``_fused_adamw_``, the kernel MindSpeed's fused AdamW uses).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op, resolve_kernel

Tensors = list[torch.Tensor]


def adamw_reference(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> tuple[Tensors, Tensors, Tensors]:
    """One AdamW step, tensor by tensor, with the math written out.

    Args:
        params: parameters, updated in place.
        grads: their gradients.
        exp_avgs: first moments, updated in place.
        exp_avg_sqs: second moments, updated in place.
        step: the step number after increment (1 on the first step).
        lr: learning rate.
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (multiplied by ``lr``).
        maximize: ascend the objective instead of descending it.

    Returns:
        ``(params, exp_avgs, exp_avg_sqs)``, the same lists.
    """
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if maximize:
            grad = -grad
        param.mul_(1.0 - lr * weight_decay)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).add_(grad * grad, alpha=1.0 - beta2)
        denom = exp_avg_sq.sqrt() / math.sqrt(bias_correction2) + eps
        param.sub_(lr / bias_correction1 * exp_avg / denom)
    return params, exp_avgs, exp_avg_sqs


def _adamw_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (2, 3, 4), (1,), (33, 17)]

    def state(fresh: bool) -> tuple[Tensors, Tensors, Tensors, Tensors]:
        def rand(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
            return (scale * torch.randn(shape, generator=gen)).to(device, dtype)

        params = [rand(s) for s in shapes]
        grads = [rand(s, 0.1) for s in shapes]
        if fresh:
            return params, grads, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        return params, grads, [rand(s, 0.05) for s in shapes], [rand(s, 0.05).square() for s in shapes]

    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    return [
        Case("first step", (*state(fresh=True), 1), hyper, grad=False),
        Case("step 7", (*state(fresh=False), 7), hyper, grad=False),
        Case(
            "no decay, maximize", (*state(fresh=False), 3), {**hyper, "weight_decay": 0.0, "maximize": True}, grad=False
        ),
        Case("large eps", (*state(fresh=False), 100), {**hyper, "eps": 1e-3, "beta2": 0.95}, grad=False),
    ]


def _adamw_bench(dtype: torch.dtype, device: torch.device) -> Case:
    params = [torch.randn(1024, 1024, device=device, dtype=dtype) for _ in range(4)]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    return Case("4 x 1024x1024", (params, grads, exp_avgs, exp_avg_sqs, 1), hyper, grad=False)


register_op(
    OpSpec(
        name="adamw",
        reference=adamw_reference,
        doc="One AdamW step over lists of tensors, in place (decoupled weight decay)",
        cases=_adamw_cases,
        bench_case=_adamw_bench,
        # The optimizer runs on fp32 master weights; the fused kernel's half-precision path
        # computes in fp32 internally, which an explicit half-precision reference cannot match.
        dtypes=(torch.float32,),
        tolerances={torch.float32: Tolerance(atol=1e-6, rtol=1e-5)},
    )
)


@register_kernel("adamw", "foreach", priority=5)
def adamw_foreach(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> tuple[Tensors, Tensors, Tensors]:
    """The reference's math with torch's multi-tensor ``_foreach_*`` ops (few kernel launches)."""
    if not params:
        return params, exp_avgs, exp_avg_sqs
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bias_correction2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias_correction1)
    return params, exp_avgs, exp_avg_sqs


#: Per accelerator name: whether torch's fused AdamW kernel runs on its devices.
_FUSED_PROBE: dict[str, bool] = {}


def _fused_adamw_available() -> bool:
    """Run the fused kernel once on a tiny tensor of the current accelerator."""
    accelerator = get_accelerator()
    if accelerator.name not in _FUSED_PROBE:
        ok = hasattr(torch, "_fused_adamw_")
        if ok:
            try:
                device = accelerator.device()
                param = torch.ones(2, device=device)
                grad = torch.ones(2, device=device)
                moments = [torch.zeros(2, device=device)], [torch.zeros(2, device=device)]
                adamw_fused([param], [grad], *moments, 1, lr=0.5, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0)
                ok = bool(torch.allclose(param.cpu(), torch.full((2,), 0.5)))
            except (RuntimeError, NotImplementedError, TypeError):  # no fused kernel for this device
                ok = False
        _FUSED_PROBE[accelerator.name] = ok
    return _FUSED_PROBE[accelerator.name]


@register_kernel("adamw", "fused", priority=10, available=_fused_adamw_available)
def adamw_fused(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
) -> tuple[Tensors, Tensors, Tensors]:
    """torch's single-kernel ``_fused_adamw_`` (one launch per device and dtype group)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, param in enumerate(params):
        groups[(param.device, param.dtype)].append(i)
    for (device, _), index in groups.items():
        # The kernel reads the step count from tensors and does not increment them.
        steps = [torch.tensor(float(step), device=device) for _ in index]
        torch._fused_adamw_(
            [params[i] for i in index],
            [grads[i] for i in index],
            [exp_avgs[i] for i in index],
            [exp_avg_sqs[i] for i in index],
            [],  # max_exp_avg_sqs: amsgrad is off
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=maximize,
        )
    return params, exp_avgs, exp_avg_sqs


class FusedAdamW(torch.optim.Optimizer):
    """AdamW whose step is the registry's ``adamw`` kernel, resolved once at construction.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.
        maximize: ascend the objective instead of descending it.
        impl: ``"auto"`` (the best available kernel), ``"reference"``, ``"foreach"`` or ``"fused"``.

    The state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) has the keys of
    ``torch.optim.AdamW``, so checkpoints load in either direction.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        impl: str = "auto",
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"FusedAdamW: lr must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"FusedAdamW: eps must be >= 0, got {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"FusedAdamW: betas must lie in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"FusedAdamW: weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)
        self.kernel = resolve_kernel("adamw", impl)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update every parameter that has a gradient; returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Parameters skipped on some steps (no grad) have their own step count.
            by_step: dict[int, tuple[Tensors, Tensors, Tensors, Tensors]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] = int(state["step"]) + 1  # int() also reads torch.optim's tensor steps
                lists = by_step.setdefault(state["step"], ([], [], [], []))
                for target, value in zip(lists, (param, param.grad, state["exp_avg"], state["exp_avg_sq"])):
                    target.append(value)
            beta1, beta2 = group["betas"]
            for step, (params, grads, exp_avgs, exp_avg_sqs) in by_step.items():
                self.kernel(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    step,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    maximize=group["maximize"],
                )
        return loss
