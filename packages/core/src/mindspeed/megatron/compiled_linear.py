"""Megatron's tensor-parallel linears inside a compiled ``TransformerLayer`` (``train.compile`` with ``parallel.tp``).

megatron-core's ``ColumnParallelLinear`` runs its GEMM in one ``autograd.Function``
(``LinearWithGradAccumulationAndAsyncCommunication``) whose backward starts the input
gradient's collective with ``async_op=True`` (``all_reduce``; with sequence parallelism the
forward's and backward's ``all_gather_into_tensor`` and the backward's ``reduce_scatter_tensor``)
to overlap it with the weight-gradient GEMM. Dynamo rewrites ``torch.distributed``'s blocking
collectives into functional ones (``torch.distributed._functional_collectives``: graph ops that
Inductor schedules and that run on every c10d backend, gloo included), but stops on an
``async_op=True`` call (``Unsupported: async_op=True for distributed collectives``).

:func:`use_traceable_linears` gives the column-parallel linears of compiled layers the same
arithmetic split differently: megatron's own blocking mappings
(``megatron.core.tensor_parallel.mappings``) around ``F.linear``,

- tensor parallelism: ``copy_to_tensor_model_parallel_region`` (identity forward, ``all_reduce``
  of the input gradient in the backward), then ``F.linear``;
- sequence parallelism: ``gather_from_sequence_parallel_region`` (``all_gather`` of the sequence
  forward, ``reduce_scatter`` of its gradient backward), then ``F.linear``,

which is what the fused function computes. The row-parallel linears already reduce their
output with those mappings after their (collective-free) GEMM and are left as they are. The
overlap of the input-gradient collective with the weight-gradient GEMM that megatron arranges by
hand is left to Inductor's scheduler (its compute/communication reordering,
``torch._inductor.config.reorder_for_compute_comm_overlap``, is off by default; not measured). The weight gradient is autograd's
``weight.grad``, which megatron's DDP hook adds to ``main_grad``: the path megatron takes with
``gradient_accumulation_fusion`` off, which compiled layers already need.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


def traceable_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Any = None,
    wgrad_deferral_limit: Any = None,
    tp_group: Any = None,
) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce``'s numbers with blocking, traceable collectives.

    Raises:
        ValueError: megatron's fused weight-gradient accumulation or deferred embedding gradients
            (neither traces; compiled layers run without them).
    """
    if gradient_accumulation_fusion or grad_output_buffer is not None:
        raise ValueError(
            "compiled tensor-parallel linears run without gradient_accumulation_fusion and "
            "defer_embedding_wgrad_compute; set train.compile=false"
        )
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return F.linear(input, weight, bias)


def use_traceable_linears(module: torch.nn.Module) -> int:
    """Give every trainable ``ColumnParallelLinear`` under ``module`` :func:`traceable_linear` (module doc).

    Returns:
        how many linears it changed (frozen ones keep megatron's ``linear_with_frozen_weight``).
    """
    count = 0
    for linear in module.modules():
        if isinstance(linear, ColumnParallelLinear) and linear.weight is not None and linear.weight.requires_grad:
            linear._forward_impl = traceable_linear
            count += 1
    return count
