"""Ascend NPU kernels for the MoE ops, through torch_npu (imported lazily, at first use).

- ``grouped_matmul``: ``torch_npu.npu_grouped_matmul`` with one ``x`` and one 3-D weight,
  ``group_type=0`` (groups along the rows of ``x``), ``group_list_type=1`` (``group_list``
  holds counts, not a cumsum) and ``split_item=2`` (one output tensor). Its backward is two
  more grouped matmuls: ``dx`` against the transposed weights, and ``dw`` with
  ``group_type=2`` (groups along the contracted token dimension, ``split_item=3``).
- ``moe_permute`` / ``moe_unpermute``: ``torch_npu.npu_moe_token_permute`` /
  ``npu_moe_token_unpermute``. They take top-k expert ids ``[tokens, topk]`` instead of a
  routing map, return (and take) the inverse of megatron's ``sorted_indices`` (the row of
  every flattened (token, k) pair, int32), and the unpermute kernel sums exactly ``topk``
  rows per token. That is exactly megatron's routing-map form when every token has the same
  number of experts (no dropped or unrouted tokens): the kernel's stable sort of expert ids
  orders the rows expert-major and, within an expert, by token, like megatron. Other maps,
  and more than 512 experts per token (the kernels' limit), run the ``native`` version.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from mindspeed.device.npu import import_torch_npu
from mindspeed.ops.grouped_matmul import check_grouped_matmul_args, grouped_matmul_reference
from mindspeed.ops.moe_permute import (
    check_num_out_tokens,
    check_permute_args,
    check_unpermute_args,
    moe_permute_native,
    moe_unpermute_native,
)
from mindspeed.ops.registry import register_kernel

#: Dtypes the kernels take (current CANN; releases before 8.0 took bf16 only for permute).
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Documented limits: experts per token for the permute kernels, groups for the grouped matmul.
_MAX_TOPK = 512
_MAX_GROUPS = 128


@functools.cache
def _torch_npu() -> Any | None:
    return import_torch_npu()


def _has(name: str):
    def probe() -> bool:
        module = _torch_npu()
        return module is not None and hasattr(module, name)

    return probe


# -- grouped matmul --------------------------------------------------------------------------------


def _gmm(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, group_type: int) -> torch.Tensor:
    split_item = 2 if group_type == 0 else 3
    return _torch_npu().npu_grouped_matmul(
        [x], [weight], bias=None, group_list=group_list, split_item=split_item, group_type=group_type, group_list_type=1
    )[0]


class _NpuGroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, group_list)
        return _gmm(x, weight, group_list, group_type=0)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, group_list = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _gmm(grad_out, weight.transpose(1, 2), group_list, group_type=0)
        if ctx.needs_input_grad[1]:
            grad_w = _gmm(x.t(), grad_out, group_list, group_type=2)  # [experts, in, out]
            # An expert without tokens gets a zero gradient; the K-grouped kernel does not
            # document what it writes for an empty group, so set it here.
            grad_w = torch.where((group_list > 0).view(-1, 1, 1), grad_w, torch.zeros_like(grad_w))
        return grad_x, grad_w, None


@register_kernel("grouped_matmul", "npu", devices=("npu",), priority=20, available=_has("npu_grouped_matmul"))
def grouped_matmul_npu(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``torch_npu.npu_grouped_matmul`` forward and backward; no rows or > 128 experts: the reference."""
    check_grouped_matmul_args(x, weight, tokens_per_expert)
    if x.shape[0] == 0 or weight.shape[0] > _MAX_GROUPS or x.dtype not in _FLOAT_DTYPES:
        return grouped_matmul_reference(x, weight, tokens_per_expert)
    group_list = tokens_per_expert.to(device=x.device, dtype=torch.int64, non_blocking=True)
    return _NpuGroupedMatmul.apply(x.contiguous(), weight.contiguous(), group_list)


# -- token permutation -------------------------------------------------------------------------------


def _uniform_topk(experts_per_token: torch.Tensor) -> int | None:
    """``k`` if every token has exactly ``k`` rows (0 < k <= 512), else ``None``; one host sync."""
    if experts_per_token.numel() == 0:
        return None
    low, high = (int(v) for v in torch.stack([experts_per_token.min(), experts_per_token.max()]).tolist())
    return high if low == high and 0 < high <= _MAX_TOPK else None


@register_kernel("moe_permute", "npu", devices=("npu",), priority=20, available=_has("npu_moe_token_permute"))
def moe_permute_npu(
    tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_moe_token_permute`` for maps with the same expert count per token."""
    check_permute_args(tokens, routing_map)
    topk = _uniform_topk(routing_map.sum(dim=1))
    if topk is None or tokens.dtype not in _FLOAT_DTYPES:
        return moe_permute_native(tokens, routing_map, num_out_tokens)
    num_rows = tokens.shape[0] * topk
    check_num_out_tokens(num_out_tokens, num_rows)
    # The routed experts of each token (exactly topk ones); their order within a token does not
    # change the output rows, only which flattened pair maps to which row.
    expert_ids = routing_map.float().topk(topk, dim=1).indices.to(torch.int32)
    permuted, row_of_pair = _torch_npu().npu_moe_token_permute(tokens, expert_ids, num_rows)
    # row_of_pair[t * topk + k] is the row of token t's k-th pair: invert it into megatron's
    # sorted_indices (the token of every row).
    pair_token = torch.arange(num_rows, device=tokens.device) // topk
    sorted_indices = torch.empty(num_rows, dtype=torch.int64, device=tokens.device)
    sorted_indices[row_of_pair.long()] = pair_token
    return permuted, sorted_indices


@register_kernel("moe_unpermute", "npu", devices=("npu",), priority=20, available=_has("npu_moe_token_unpermute"))
def moe_unpermute_npu(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch_npu.npu_moe_token_unpermute`` for maps with the same expert count per token."""
    check_unpermute_args(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    num_tokens = int(restore_shape[0])
    rows_per_token = torch.zeros(num_tokens, device=sorted_indices.device).index_add_(
        0, sorted_indices, torch.ones(sorted_indices.shape, device=sorted_indices.device)
    )
    topk = _uniform_topk(rows_per_token)
    if topk is None or permuted_tokens.dtype not in _FLOAT_DTYPES:
        return moe_unpermute_native(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    # Rows are expert-major, so a stable sort by token lists each token's rows in expert order:
    # the (token, k) -> row map the kernel gathers with.
    row_of_pair = torch.sort(sorted_indices, stable=True).indices.to(torch.int32)
    if probs is None:
        dtype = permuted_tokens.dtype
        # Without probs the kernel assumes one row per token; ones make it sum topk rows exactly.
        pair_probs = torch.ones(num_tokens, topk, dtype=dtype, device=permuted_tokens.device)
    else:
        dtype = torch.result_type(permuted_tokens, probs)  # megatron multiplies in the promoted dtype
        # Boolean indexing is token-major with experts ascending: the k-th pair of each token.
        pair_probs = probs[routing_map.bool()].view(num_tokens, topk).to(dtype)
    out = _torch_npu().npu_moe_token_unpermute(permuted_tokens.to(dtype), row_of_pair, pair_probs)
    return out.to(permuted_tokens.dtype)
