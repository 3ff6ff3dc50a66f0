"""Compute-communication overlap (CoC) in megatron-core's tensor-parallel linear layers.

Under sequence parallelism megatron's ``ColumnParallelLinear`` all-gathers its input along the
sequence before its GEMM and ``RowParallelLinear`` reduce-scatters its output after it (without
sequence parallelism it all-reduces it). The subclasses here run those pairs as the registry ops
``all_gather_matmul``, ``matmul_reduce_scatter`` and ``matmul_all_reduce`` (the ``chunked``
pipeline, or the Ascend extension's fused MC2 kernels), so the collective of one sequence chunk overlaps the
GEMM of another. The layer spec names them for
the attention's ``linear_qkv`` / ``linear_proj`` and the dense MLP's ``linear_fc1`` / ``linear_fc2``
(:func:`apply_coc`); parameters, checkpoints and everything else stay megatron's. Where a column
layer is not under sequence parallelism (its forward has no collective), or the weight is frozen,
or megatron defers the weight gradient, megatron's own path runs. Megatron's gradient-accumulation fusion is kept:
the weight gradient is added into ``main_grad`` through the same module function megatron calls.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from mindspeed.megatron.grad_accum import bound_wgrad_accumulators
from mindspeed.ops import resolve_kernel

#: Chunks of the sequence a CoC layer pipelines by default (MindSpeed's ``--coc-parallel-num``).
DEFAULT_NUM_CHUNKS = 2


def accumulate_main_grad(weight: torch.Tensor, total_input: torch.Tensor, grad_output: torch.Tensor) -> Any:
    """Megatron's gradient-accumulation fusion for a weight gradient (its backward's branch).

    ``main_grad += grad_output^T @ total_input`` through the accumulators ``adapt()`` bound
    megatron's linear layers to (the registry's ``matmul_add_fp32``:
    :func:`~mindspeed.megatron.grad_accum.bound_wgrad_accumulators`); returns the dummy gradient DDP
    skips (``grad_added_to_main_grad``), or ``None``.
    """
    if not hasattr(weight, "main_grad"):
        return grad_output.t().matmul(total_input)
    accumulators = bound_wgrad_accumulators()
    if weight.main_grad.dtype == torch.float32:
        accumulators.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    else:
        accumulators.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=total_input.dtype, device=total_input.device)


class _AddBias(torch.autograd.Function):
    """``x + bias`` whose bias gradient is summed over the flattened tokens, as megatron's linear
    sums it (``grad_output.view(-1, out).sum(dim=0)``): the same summation order by construction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.reshape(-1, grad.shape[-1]).sum(dim=0)


class CoCColumnParallelLinear(ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` whose sequence all-gather + GEMM is ``all_gather_matmul``.

    Args:
        impl: the ``all_gather_matmul`` implementation ("chunked", "npu", "reference", "auto").
        num_chunks: sequence chunks of the pipeline.
        *args, **kwargs: megatron's arguments.
    """

    def __init__(self, *args: Any, impl: str = "auto", num_chunks: int = DEFAULT_NUM_CHUNKS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.coc_kernel = resolve_kernel("all_gather_matmul", impl)
        self.coc_num_chunks = num_chunks

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        deferred = kwargs.get("grad_output_buffer") is not None
        if args or deferred or not kwargs.get("sequence_parallel") or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        fn = accumulate_main_grad if kwargs.get("gradient_accumulation_fusion") else None
        output = self.coc_kernel(input, weight, kwargs["tp_group"], self.coc_num_chunks, fn)
        bias = kwargs.get("bias")
        return output if bias is None else _AddBias.apply(output, bias)


class CoCRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` whose GEMM + sequence reduce-scatter is ``matmul_reduce_scatter``
    (without sequence parallelism: whose GEMM + all-reduce is ``matmul_all_reduce``).

    Args:
        impl: the ``matmul_reduce_scatter`` implementation.
        num_chunks: sequence chunks of the pipeline.
        all_reduce_impl: the ``matmul_all_reduce`` implementation.
        *args, **kwargs: megatron's arguments.
    """

    def __init__(
        self,
        *args: Any,
        impl: str = "auto",
        num_chunks: int = DEFAULT_NUM_CHUNKS,
        all_reduce_impl: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.coc_kernel = resolve_kernel("matmul_reduce_scatter", impl)
        self.coc_all_reduce_kernel = resolve_kernel("matmul_all_reduce", all_reduce_impl)
        self.coc_num_chunks = num_chunks

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """megatron's forward with the GEMM and the reduce-scatter (all-reduce) as one pipelined op."""
        if not self.input_is_parallel or self.explicit_expert_comm or not self.weight.requires_grad:
            return super().forward(input_)
        fn = accumulate_main_grad if self.gradient_accumulation_fusion else None
        kernel = self.coc_kernel if self.sequence_parallel else self.coc_all_reduce_kernel
        output = kernel(input_, self.weight, self.tp_group, self.coc_num_chunks, fn)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def apply_coc(
    spec: ModuleSpec,
    column_impl: str,
    row_impl: str,
    all_reduce_impl: str = "auto",
    num_chunks: int = DEFAULT_NUM_CHUNKS,
) -> ModuleSpec:
    """Put the CoC linears into a GPT layer spec (in place; returned): attention's QKV and
    projection, and the dense MLP's (or the shared experts') fc1 and fc2."""
    column = ModuleSpec(module=CoCColumnParallelLinear, params={"impl": column_impl, "num_chunks": num_chunks})
    row_params = {"impl": row_impl, "num_chunks": num_chunks, "all_reduce_impl": all_reduce_impl}
    row = ModuleSpec(module=CoCRowParallelLinear, params=row_params)
    sub = spec.submodules
    attn = sub.self_attention.submodules
    if attn.linear_qkv is ColumnParallelLinear:
        attn.linear_qkv = column
    if attn.linear_proj is RowParallelLinear:
        attn.linear_proj = row
    mlp = sub.mlp.submodules
    targets = [mlp] if hasattr(mlp, "linear_fc1") else []
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None and getattr(shared, "submodules", None) is not None:
        targets.append(shared.submodules)
    for target in targets:
        if target.linear_fc1 is ColumnParallelLinear:
            target.linear_fc1 = column
        if target.linear_fc2 is RowParallelLinear:
            target.linear_fc2 = row
    return spec
