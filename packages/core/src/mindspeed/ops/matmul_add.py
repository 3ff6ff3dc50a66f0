"""Weight-gradient accumulation into an fp32 main grad: ``matmul_add_fp32``.

Megatron's ``gradient_accumulation_fusion``: the backward of a linear layer adds
``grad_output^T @ total_input`` straight into the parameter's fp32 ``main_grad`` instead of
materialising a half-precision weight gradient, rounding it, and adding it afterwards. The
product is accumulated in fp32 whatever the input dtype; ``main_grad`` is updated in place.
"""

from __future__ import annotations

import torch

from mindspeed.log import get_logger
from mindspeed.ops.registry import Case, OpSpec, register_kernel, register_op

logger = get_logger(__name__)


def flatten_matmul_add_inputs(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes and fold the leading dimensions: ``([N, in], [N, out])``.

    Raises:
        ValueError: on mismatched token counts or a ``main_grad`` that is not ``[out, in]`` fp32.
    """
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if x.shape[0] != g.shape[0]:
        raise ValueError(
            f"matmul_add_fp32: total_input {list(total_input.shape)} and grad_output "
            f"{list(grad_output.shape)} must have the same leading (token) dimensions"
        )
    if main_grad.shape != (g.shape[1], x.shape[1]) or main_grad.dtype != torch.float32:
        raise ValueError(
            f"matmul_add_fp32: main_grad must be fp32 [out, in] = [{g.shape[1]}, {x.shape[1]}], "
            f"got {main_grad.dtype} {list(main_grad.shape)}"
        )
    return x, g


def matmul_add_fp32_reference(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> torch.Tensor:
    """``main_grad += grad_output^T @ total_input``, product and sum in fp32, in place.

    Args:
        total_input: the layer's input, ``[N, in]`` or ``[s, b, in]`` (any float dtype).
        grad_output: the gradient of its output, ``[N, out]`` or ``[s, b, out]``.
        main_grad: the fp32 accumulator ``[out, in]``, updated in place.

    Returns:
        ``main_grad``.
    """
    x, g = flatten_matmul_add_inputs(total_input, grad_output, main_grad)
    main_grad.add_(g.float().t() @ x.float())
    return main_grad


def _matmul_add_naive(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused path: the weight gradient in the input dtype, then an add."""
    x, g = flatten_matmul_add_inputs(total_input, grad_output, main_grad)
    main_grad.add_(g.t() @ x)
    return main_grad


def _matmul_add_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(x_shape: tuple[int, ...], out_features: int) -> tuple:
        x = torch.randn(x_shape, generator=gen).to(device, dtype)
        g = torch.randn((*x_shape[:-1], out_features), generator=gen).to(device, dtype)
        main_grad = torch.randn(out_features, x_shape[-1], generator=gen).to(device)  # always fp32
        return x, g, main_grad

    x, g, main_grad = make((24, 8, 16), 12)
    return [
        Case("2d odd", make((37, 19), 23), grad=False),
        Case("3d [s, b, h]", make((5, 3, 24), 40), grad=False),
        Case("one token", make((1, 7), 5), grad=False),
        Case("no tokens", make((0, 6), 4), grad=False),
        # A transposed [b, s, h] view: the inputs of a layer are not always contiguous.
        Case("non-contiguous", (x.transpose(0, 1), g.transpose(0, 1), main_grad), grad=False),
    ]


def _matmul_add_bench(dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(2048, 1024, device=device, dtype=dtype)
    g = torch.randn(2048, 1024, device=device, dtype=dtype)
    return Case("2048 tokens 1024x1024", (x, g, torch.zeros(1024, 1024, device=device)), grad=False)


register_op(
    OpSpec(
        name="matmul_add_fp32",
        reference=matmul_add_fp32_reference,
        doc="main_grad += grad_output^T @ total_input in fp32 (gradient accumulation fusion)",
        cases=_matmul_add_cases,
        bench_case=_matmul_add_bench,
        naive=_matmul_add_naive,
    )
)

#: Per (device type, input dtype): whether ``addmm(out_dtype=float32)`` accumulates correctly.
_MIXED_ADDMM: dict[tuple[str, torch.dtype], bool] = {}


def _mixed_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per device type and dtype for torch's mixed-dtype addmm (fp32 output)."""
    key = (device.type, dtype)
    if key not in _MIXED_ADDMM:
        try:
            acc = torch.ones(2, 2, device=device)
            a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=dtype)
            torch.addmm(acc, a.t(), a, out_dtype=torch.float32, out=acc)
            expected = torch.tensor([[11.0, 15.0], [15.0, 21.0]])
            _MIXED_ADDMM[key] = bool(torch.equal(acc.cpu(), expected))
        except (RuntimeError, NotImplementedError, TypeError):  # no such kernel on this device
            _MIXED_ADDMM[key] = False
        logger.debug("matmul_add_fp32: mixed-dtype addmm for %s on %s: %s", dtype, device.type, _MIXED_ADDMM[key])
    return _MIXED_ADDMM[key]


@register_kernel("matmul_add_fp32", "native", priority=5)
def matmul_add_fp32_native(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> torch.Tensor:
    """One in-place ``addmm_`` into ``main_grad``, without an ``[out, in]`` temporary.

    Half-precision inputs go through torch's mixed-dtype ``addmm(out_dtype=float32)`` where the
    device has it (the GEMM accumulates into fp32 directly, no fp32 copies of the inputs); elsewhere
    they are upcast first.
    """
    x, g = flatten_matmul_add_inputs(total_input, grad_output, main_grad)
    if x.dtype == g.dtype == torch.float32:
        main_grad.addmm_(g.t(), x)
    elif x.dtype == g.dtype and main_grad.is_contiguous() and _mixed_addmm_works(main_grad.device, x.dtype):
        torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(g.t().float(), x.float())
    return main_grad
