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
    GradWeightFn,
    _grad_weight,
    _MatmulAllReduceRef,
    all_gather_matmul_chunked,
    matmul_all_reduce_chunked,
    matmul_reduce_scatter_chunked,
)
from mindspeed.ops.registry import register_kernel

_NPU = ("npu",)


def _hcom(group: Any) -> str:
    """The HCCL communicator name of ``group`` (what the fused kernels take)."""
    rank = dist.get_rank(group)
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def _ag_mm(x2d: torch.Tensor, w_t: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _torch_npu().npu_all_gather_base_mm(x2d, w_t, _hcom(group), dist.get_world_size(group), gather_output=True)


def _mm_rs(x2d: torch.Tensor, w_t: torch.Tensor, group: Any) -> torch.Tensor:
    return _torch_npu().npu_mm_reduce_scatter_base(x2d, w_t, _hcom(group), dist.get_world_size(group))


class _AllGatherMatmulNpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, fn: Any) -> torch.Tensor:
        out, total = _ag_mm(x.reshape(-1, x.shape[-1]), weight.t(), group)
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.grad_weight_fn, ctx.shape = group, fn, x.shape
        return out.view(-1, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total, weight = ctx.saved_tensors
        grad_input = _mm_rs(grad.reshape(-1, grad.shape[-1]), weight, ctx.group).view(ctx.shape)
        return grad_input, _grad_weight(ctx.grad_weight_fn, weight, total, grad), None, None


class _MatmulReduceScatterNpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.grad_weight_fn = group, fn
        out = _mm_rs(x.reshape(-1, x.shape[-1]), weight.t(), group)
        return out.view(-1, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        grad_input, total_grad = _ag_mm(grad.reshape(-1, grad.shape[-1]), weight, ctx.group)
        grad_input = grad_input.view(x.shape)
        return grad_input, _grad_weight(ctx.grad_weight_fn, weight, x, total_grad), None, None


@register_kernel("all_gather_matmul", "npu", devices=_NPU, priority=20, available=_has("npu_all_gather_base_mm"))
def all_gather_matmul_npu(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """``npu_all_gather_base_mm`` (chunking is the kernel's own); one rank: the chunked path."""
    if group is None or dist.get_world_size(group) == 1:
        return all_gather_matmul_chunked(x, weight, group, num_chunks, grad_weight_fn)
    return _AllGatherMatmulNpu.apply(x, weight, group, grad_weight_fn)


@register_kernel(
    "matmul_reduce_scatter", "npu", devices=_NPU, priority=20, available=_has("npu_mm_reduce_scatter_base")
)
def matmul_reduce_scatter_npu(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """``npu_mm_reduce_scatter_base``; one rank: the chunked path."""
    if group is None or dist.get_world_size(group) == 1:
        return matmul_reduce_scatter_chunked(x, weight, group, num_chunks, grad_weight_fn)
    return _MatmulReduceScatterNpu.apply(x, weight, group, grad_weight_fn)


class _MatmulAllReduceNpu(_MatmulAllReduceRef):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.grad_weight_fn = fn
        out = _torch_npu().npu_mm_all_reduce_base(x.reshape(-1, x.shape[-1]), weight.t(), _hcom(group))
        return out.view(*x.shape[:-1], weight.shape[0])


@register_kernel("matmul_all_reduce", "npu", devices=_NPU, priority=20, available=_has("npu_mm_all_reduce_base"))
def matmul_all_reduce_npu(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """``npu_mm_all_reduce_base`` (the backward has no communication); one rank: the chunked path."""
    if group is None or dist.get_world_size(group) == 1:
        return matmul_all_reduce_chunked(x, weight, group, num_chunks, grad_weight_fn)
    return _MatmulAllReduceNpu.apply(x, weight, group, grad_weight_fn)
