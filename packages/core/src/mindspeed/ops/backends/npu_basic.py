"""torch_npu kernels for the elementwise, GEMM and optimizer ops: rms_norm, swiglu, rotary_pos_emb,
matmul_add_fp32, ema_adamw.

Each registers for the ``npu`` accelerator with a probe that imports torch_npu only when the
registry resolves a kernel, never at import time. The wrappers keep the semantics of the
references (dtypes included): where a vendor kernel cannot honour a call exactly (mixed
dtypes, a layout it does not support) the wrapper adapts the inputs or uses the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mindspeed.device.npu import import_torch_npu
from mindspeed.log import get_logger, log_once
from mindspeed.ops.activations import check_swiglu_input
from mindspeed.ops.ema_adamw import ema_adamw_reference
from mindspeed.ops.matmul_add import flatten_matmul_add_inputs
from mindspeed.ops.registry import register_kernel
from mindspeed.ops.rotary import check_rotary_inputs, rotary_pos_emb_reference

logger = get_logger(__name__)

_NPU = ("npu",)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _torch_npu() -> Any:
    """The torch_npu module (imported on first use; the probes ran before any call)."""
    module = import_torch_npu()
    if module is None:
        raise RuntimeError("torch_npu is not importable; resolve the kernel with impl='auto' or 'reference'")
    return module


def _has(name: str) -> Callable[[], bool]:
    """Probe: torch_npu loads and exposes ``name``."""

    @functools.cache
    def probe() -> bool:
        module = import_torch_npu()
        return module is not None and hasattr(module, name)

    return probe


# -- rms_norm ---------------------------------------------------------------------------------


@register_kernel("rms_norm", "npu", devices=_NPU, priority=20, available=_has("npu_rms_norm"))
def rms_norm_npu(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``torch_npu.npu_rms_norm`` (fp32 statistics inside the kernel); returns ``x.dtype``."""
    npu = _torch_npu()
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if weight.dtype == x.dtype:
        return npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    # The kernel wants gamma in x's dtype; rounding an fp32 weight would break parity with the
    # reference, which scales in fp32. Normalise in fp32 instead and cast once.
    return npu.npu_rms_norm(x.float(), weight.float(), epsilon=eps)[0].to(x.dtype)


# -- swiglu -----------------------------------------------------------------------------------


@register_kernel("swiglu", "npu", devices=_NPU, priority=20, available=_has("npu_swiglu"))
def swiglu_npu(x: torch.Tensor) -> torch.Tensor:
    """``torch_npu.npu_swiglu`` over the last dimension (gate first, like the reference)."""
    check_swiglu_input(x)
    return _torch_npu().npu_swiglu(x.contiguous(), dim=-1)  # the kernel rejects strided inputs


# -- rotary_pos_emb ---------------------------------------------------------------------------

#: Which leading dims of the 4-D table are full (not 1), for the layouts npu_rotary_mul accepts:
#: BNSD x with 11SD/B1SD/BNSD tables, BSND with 1S1D/BS1D/BSND, SBND with S11D/SB1D/SBND.
_ROTARY_TABLE_PATTERNS = {
    (False, False, True),
    (True, False, True),
    (True, True, True),
    (False, True, False),
    (True, True, False),
    (True, False, False),
}
_ROTARY_MAX_HEAD_DIM = 896  # documented bound (exclusive) of the last dimension
_ROTARY_MAX_BATCH_HEADS = 1000  # documented bound (exclusive) of B and N
_ROTARY_MAX_TABLE_GRAD_ROWS = 1024  # documented bound of B * N when cos/sin need gradients


@functools.cache
def _rotary_has_interleave() -> bool:
    # torch_npu added ``rotary_mode`` to npu_rotary_mul in 2.5/2.6; older builds rotate halves only.
    try:
        return "rotary_mode" in str(torch.ops.npu.npu_rotary_mul.default._schema)
    except (AttributeError, RuntimeError):
        return False


def _rotary_kernel_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> bool:
    """Whether the call lies within npu_rotary_mul's documented shape limits."""
    if x.dim() != 4 or cos.dim() > 4 or rot_dim >= _ROTARY_MAX_HEAD_DIM:
        return False
    table = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    if any(t not in (1, s) for t, s in zip(table[:3], x.shape[:3])):
        return False
    full = tuple(t != 1 or s == 1 for t, s in zip(table[:3], x.shape[:3]))
    if full not in _ROTARY_TABLE_PATTERNS:
        return False
    # B and N must stay below 1000. Which dims they are depends on the layout; the sequence is
    # the long one in practice, so the two shortest dims are taken as batch and heads.
    batch, heads = sorted(x.shape[:3])[:2]
    if heads >= _ROTARY_MAX_BATCH_HEADS:
        return False
    # The kernel's table gradient is limited to B * N <= 1024.
    return not (cos.requires_grad or sin.requires_grad) or batch * heads <= _ROTARY_MAX_TABLE_GRAD_ROWS


@register_kernel("rotary_pos_emb", "npu", devices=_NPU, priority=20, available=_has("npu_rotary_mul"))
def rotary_pos_emb_npu(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """``torch_npu.npu_rotary_mul`` on the rotated channels; other calls go to the reference.

    The kernel takes 4-D ``x`` and tables in the BNSD, BSND or SBND layouts with a head dim
    below 896; the interleaved mode needs a torch_npu whose kernel has ``rotary_mode``.
    """
    rot_dim = check_rotary_inputs(x, cos, sin)
    if not _rotary_kernel_fits(x, cos, sin, rot_dim) or (interleaved and not _rotary_has_interleave()):
        log_once(
            logger,
            "rotary_pos_emb[npu]: some calls are outside npu_rotary_mul's shape or mode "
            "limits and run the reference instead",
        )
        return rotary_pos_emb_reference(x, cos, sin, interleaved)
    table_shape = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    cos, sin = cos.reshape(table_shape), sin.reshape(table_shape)
    x_rot = x[..., :rot_dim].contiguous()
    # Same dtype for all three inputs; mixed dtypes run in fp32, as the reference would.
    compute = x.dtype if cos.dtype == x.dtype == sin.dtype else torch.float32
    args = (x_rot.to(compute), cos.to(compute).contiguous(), sin.to(compute).contiguous())
    npu = _torch_npu()
    if interleaved:
        out = npu.npu_rotary_mul(*args, rotary_mode="interleave")
    else:
        out = npu.npu_rotary_mul(*args)
    out = out.to(x.dtype)
    if rot_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot_dim:]), dim=-1)


# -- matmul_add_fp32 --------------------------------------------------------------------------


@functools.cache
def _matmul_add_op() -> Callable[..., Any] | None:
    """torch_npu's in-place ``C += x^T @ weight`` (ATB LinearOperation), or ``None``."""
    module = import_torch_npu()
    if module is None:
        return None
    if hasattr(module, "npu_matmul_add_fp32"):
        return module.npu_matmul_add_fp32
    try:
        return torch.ops.atb._npu_matmul_add_fp32  # registered by torch_npu's op-plugin with ATB
    except (AttributeError, RuntimeError):
        return None


@register_kernel("matmul_add_fp32", "npu", devices=_NPU, priority=20, available=lambda: _matmul_add_op() is not None)
def matmul_add_fp32_npu(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """The fused ATB GEMM that accumulates half-precision products into the fp32 main grad.

    The kernel takes fp16/bf16 inputs and a contiguous fp32 accumulator; fp32 inputs use an
    in-place ``addmm_``. Empty inputs return at once (the kernel rejects them; the product is 0).
    """
    x, g = flatten_matmul_add_inputs(total_input, grad_output, main_grad)
    if x.numel() == 0 or g.numel() == 0:
        return main_grad
    if x.dtype in _HALF_DTYPES and g.dtype == x.dtype and main_grad.is_contiguous():
        _matmul_add_op()(g.contiguous(), x.contiguous(), main_grad)  # main_grad += g^T @ x
    else:
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))
    return main_grad


# -- ema_adamw --------------------------------------------------------------------------------


@register_kernel("ema_adamw", "npu", devices=_NPU, priority=20, available=_has("npu_apply_fused_ema_adamw"))
def ema_adamw_npu(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    ema_params: list[torch.Tensor],
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    ema_decay: float,
    maximize: bool = False,
) -> tuple[list[torch.Tensor], ...]:
    """``torch_npu.npu_apply_fused_ema_adamw`` per tensor (MindSpeed's fused_ema_adamw, AdamW mode 1).

    The kernel takes fp32 tensors of one shape and an int64 step of shape (1,); other dtypes go
    through the reference. Its outputs are copied back where it did not update in place.
    """
    npu = _torch_npu()
    for param, grad, exp_avg, exp_avg_sq, ema in zip(params, grads, exp_avgs, exp_avg_sqs, ema_params, strict=True):
        tensors = (param, exp_avg, exp_avg_sq, ema)
        if any(t.dtype != torch.float32 for t in (*tensors, grad)):
            ema_adamw_reference(
                [param],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [ema],
                step,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
                ema_decay=ema_decay,
                maximize=maximize,
            )
            continue
        step_tensor = torch.full((1,), step, dtype=torch.int64, device=param.device)
        outputs = npu.npu_apply_fused_ema_adamw(
            -grad if maximize else grad,
            param,
            exp_avg,
            exp_avg_sq,
            ema,
            step_tensor,
            lr,
            ema_decay,
            beta1,
            beta2,
            eps,
            1,
            True,
            weight_decay,
        )
        for target, out in zip(tensors, outputs, strict=True):
            if out.data_ptr() != target.data_ptr():
                target.copy_(out)
    return params, exp_avgs, exp_avg_sqs, ema_params
