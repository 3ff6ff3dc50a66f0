"""torch_npu's fused matmul + collective kernels (MindSpeed's MC2, ``--use-ascend-mc2``).

``torch_npu.npu_all_gather_base_mm`` all-gathers the first operand over an HCCL communicator
and multiplies it in one kernel (it also returns the gathered input, kept here for the weight
gradient); ``torch_npu.npu_mm_reduce_scatter_base`` multiplies and reduce-scatters. Their
backwards are each other's kernel, as in MindSpeed. Both take 2-D operands and the
communicator's name, so the sequence layout ``[s, b, h]`` is folded to ``[s * b, h]`` (the
sequence dim stays outermost, so a rank's rows stay contiguous). Registered for the ``npu``
accelerator only, probed lazily: where torch_npu is absent the registry does not offer them.
Not run on this project's CI (no Ascend host); the parity test runs them on one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mindspeed.ops.backends.npu_basic import _has, _torch_npu
from mindspeed.ops.coc import (
    CocKernels,
    GradWeightFn,
    all_gather_matmul_chunked,
    matmul_all_reduce_chunked,
    matmul_reduce_scatter_chunked,
    run_coc,
)
from mindspeed.ops.registry import register_kernel

_NPU = ("npu",)


def _hcom(group: Any) -> str:
    """The HCCL communicator name of ``group`` (what the fused kernels take)."""
    rank = dist.get_rank(group)
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _ag_mm(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int, keep: bool) -> Any:
    """``npu_all_gather_base_mm`` (its chunking is the kernel's own); the gathered input comes back too."""
    out, total = _torch_npu().npu_all_gather_base_mm(
        _flat(x), w.t(), _hcom(group), dist.get_world_size(group), gather_output=True
    )
    return out.view(-1, *x.shape[1:-1], w.shape[0]), total.view(-1, *x.shape[1:])


def _mm_rs(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    out = _torch_npu().npu_mm_reduce_scatter_base(_flat(x), w.t(), _hcom(group), dist.get_world_size(group))
    return out.view(-1, *x.shape[1:-1], w.shape[0])


def _mm_ar(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    out = _torch_npu().npu_mm_all_reduce_base(_flat(x), w.t(), _hcom(group))
    return out.view(*x.shape[:-1], w.shape[0])


#: The fused kernels; the gathered input of the forward is kept for the weight gradient.
NPU = CocKernels(_ag_mm, _mm_rs, _mm_ar, keeps_gathered=True)


def _on_npu(op: str, chunked: Any) -> Any:
    def kernel(
        x: torch.Tensor,
        weight: torch.Tensor,
        group: Any = None,
        num_chunks: int = 1,
        grad_weight_fn: GradWeightFn | None = None,
    ) -> torch.Tensor:
        if group is None or dist.get_world_size(group) == 1:
            return chunked(x, weight, group, num_chunks, grad_weight_fn)
        return run_coc(op, NPU, x, weight, group, num_chunks, grad_weight_fn)

    kernel.__name__ = f"{op}_npu"
    kernel.__doc__ = f"torch_npu's fused kernel for ``{op}``; one rank: the chunked path."
    return kernel


all_gather_matmul_npu = register_kernel(
    "all_gather_matmul", "npu", devices=_NPU, priority=20, available=_has("npu_all_gather_base_mm")
)(_on_npu("all_gather_matmul", all_gather_matmul_chunked))
matmul_reduce_scatter_npu = register_kernel(
    "matmul_reduce_scatter", "npu", devices=_NPU, priority=20, available=_has("npu_mm_reduce_scatter_base")
)(_on_npu("matmul_reduce_scatter", matmul_reduce_scatter_chunked))
matmul_all_reduce_npu = register_kernel(
    "matmul_all_reduce", "npu", devices=_NPU, priority=20, available=_has("npu_mm_all_reduce_base")
)(_on_npu("matmul_all_reduce", matmul_all_reduce_chunked))


# -- npu_mm_all_reduce_add_rms_norm -------------------------------------------------------------


@register_kernel(
    "mm_all_reduce_add_rms_norm", "npu", devices=_NPU, priority=20, available=_has("npu_mm_all_reduce_add_rms_norm")
)
def mm_all_reduce_add_rms_norm_npu(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    group: Any = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_mm_all_reduce_add_rms_norm`` (MindSpeed's MC2 kernel): one launch for the
    matmul, the HCCL all-reduce, the residual add and the rms_norm; same arguments and results
    as :func:`mindspeed.ops.coc.mm_all_reduce_add_rms_norm_reference`.

    The argument order is MindSpeed's (``x1, x2, residual, gamma, hcom, reduce_op, epsilon``),
    over CANN's ``aclnnMatmulAllReduceAddRmsNorm``; MindSpeed builds the binding as its own op,
    so the probe offers this kernel only where the installed torch_npu exposes it. The kernel
    takes the matmul's second operand as ``[in, hidden]`` (``weight^T``) and the
    residual as ``[b, s, hidden]``, so ``x`` is folded to 3-D with the last dim kept. The bias
    is folded into the residual (``y = (residual + bias) + all_reduce(x W^T)``: added once, as
    the reference adds it). The kernel has no backward: where a gradient is needed, and on a
    single rank, the registry's unfused ops run instead (the result is the reference's).
    """
    from mindspeed.ops.coc import mm_all_reduce_add_rms_norm_reference

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, residual, gamma, bias)
    )
    if needs_grad or group is None or dist.get_world_size(group) == 1:
        return mm_all_reduce_add_rms_norm_reference(x, weight, residual, gamma, group, eps, bias)
    hidden = weight.shape[0]
    x3 = x.reshape(1, -1, x.shape[-1]) if x.dim() == 2 else x.reshape(-1, x.shape[-2], x.shape[-1])
    residual3 = residual.reshape(*x3.shape[:-1], hidden)
    if bias is not None:
        residual3 = residual3 + bias
    y, normed = _torch_npu().npu_mm_all_reduce_add_rms_norm(
        x3, weight.t(), residual3, gamma, _hcom(group), reduce_op="sum", epsilon=eps
    )
    return y.view(*x.shape[:-1], hidden), normed.view(*x.shape[:-1], hidden)
