"""Gradient-accumulation fusion for megatron-core's linear layers, on the kernel registry.

With ``TransformerConfig(gradient_accumulation_fusion=True)`` megatron's
``LinearWithGradAccumulationAndAsyncCommunication.backward`` adds the weight gradient straight
into the parameter's ``main_grad`` (the DDP buffer, fp32 with ``grad_reduce_in_fp32``) by
calling ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output,
main_grad)``, Apex's CUDA extension, and returns a dummy weight gradient that DDP skips
(``grad_added_to_main_grad``). Without Apex the module name is unbound and the linear layers
refuse the flag (``_grad_accum_fusion_available``). :func:`gradient_accumulation_fusion_patches`
binds that name to the registry's ``matmul_add_fp32`` and lifts the refusal; ``adapt()`` adds
them when the ``gradient_accumulation_fusion`` feature is on (the feature sets the config flag).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from mindspeed.megatron.patches import MEGATRON_VERSIONS
from mindspeed.ops import resolve_kernel
from mindspeed.patching import UpstreamPatch

_LAYERS = "megatron.core.tensor_parallel.layers"


def wgrad_accumulators(impl: str = "auto") -> SimpleNamespace:
    """Apex's ``fused_weight_gradient_mlp_cuda`` interface on the registry kernel ``impl``.

    Returns:
        A namespace with ``wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)``
        (``main_grad += grad_output^T @ total_input``, fp32 accumulation: the registry's
        ``matmul_add_fp32``) and ``wgrad_gemm_accum_fp16`` for a half-precision ``main_grad``
        (no fp32 buffer to accumulate into: one GEMM in that dtype, added in place).
    """
    kernel = resolve_kernel("matmul_add_fp32", impl)

    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        kernel(total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        x = total_input.reshape(-1, total_input.shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))

    return SimpleNamespace(
        wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16, kernel=kernel
    )


#: The accumulators megatron's linear layers were last bound to (``None``: not adapted yet).
_BOUND: SimpleNamespace | None = None


def bound_wgrad_accumulators() -> SimpleNamespace:
    """The accumulators :func:`gradient_accumulation_fusion_patches` bound megatron's linear layers to
    (the registry's default kernel before any run bound them): layers that run megatron's backward
    branch themselves (CoC) accumulate through the same kernel."""
    global _BOUND
    if _BOUND is None:
        _BOUND = wgrad_accumulators()
    return _BOUND


def _bind(impl: str) -> SimpleNamespace:
    global _BOUND
    _BOUND = wgrad_accumulators(impl)
    return _BOUND


def gradient_accumulation_fusion_patches(impl: str = "auto") -> list[UpstreamPatch]:
    """Patches that make megatron's ``gradient_accumulation_fusion`` run the registry kernel ``impl``.

    Both are reverted by ``unadapt()``: the module name is deleted again where Apex is absent,
    or Apex's module is put back where it is installed.
    """
    common = dict(distribution="megatron-core", versions=MEGATRON_VERSIONS)
    return [
        UpstreamPatch(
            "grad-accum-fusion-kernel",
            f"{_LAYERS}.fused_weight_gradient_mlp_cuda",
            lambda original, acc: _bind(impl),
            allow_missing=True,
            reason="the linear layers' backward calls Apex's fused_weight_gradient_mlp_cuda by module "
            "name; no spec seam reaches it",
            **common,
        ),
        UpstreamPatch(
            "grad-accum-fusion-available",
            f"{_LAYERS}._grad_accum_fusion_available",
            _available,
            reason="Column/RowParallelLinear refuse gradient_accumulation_fusion when Apex did not import",
            **common,
        ),
    ]


def _available(original: Any, acc: Any) -> bool:
    return True
