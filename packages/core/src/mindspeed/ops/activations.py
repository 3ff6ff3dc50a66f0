"""Gated activations: ``swiglu``.

``swiglu(x)`` takes the fused fc1 output of a gated MLP, ``[..., 2 * ffn]`` with the gate in
the first half and the up projection in the second (Megatron's layout), and returns
``silu(gate) * up``. Half-precision inputs are computed in fp32 and returned in their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from mindspeed.ops.registry import Case, OpSpec, register_kernel, register_op

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    # fp32 math for half precision only: a float64 input (gradcheck) keeps its precision.
    return x.float() if x.dtype in _HALF_DTYPES else x


def check_swiglu_input(x: torch.Tensor) -> None:
    """Raise a ``ValueError`` unless the last dimension of ``x`` splits into gate and up halves."""
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"swiglu expects x of shape [..., 2 * ffn] (gate and up concatenated), got {list(x.shape)}; "
            "the last dimension must be even"
        )


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``.

    Args:
        x: ``[..., 2 * ffn]``, gate first.

    Returns:
        ``[..., ffn]`` in ``x.dtype`` (computed in fp32 for half-precision inputs).
    """
    check_swiglu_input(x)
    gate, up = _upcast(x).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _swiglu_naive(x: torch.Tensor) -> torch.Tensor:
    """Naive version: everything in the input dtype, intermediates kept by autograd."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(*shape: int, scale: float = 1.0) -> tuple[torch.Tensor]:
        return ((scale * torch.randn(shape, generator=gen)).to(device, dtype),)

    return [
        Case("2d", make(16, 2 * 64)),
        Case("3d odd ffn", make(3, 7, 2 * 33)),
        Case("4d", make(2, 3, 5, 2 * 48)),
        Case("1d", make(2 * 5)),
        # Large magnitudes push the sigmoid into saturation, where a sloppy derivative breaks.
        Case("saturated", make(4, 2 * 40, scale=12.0)),
    ]


register_op(
    OpSpec(
        name="swiglu",
        reference=swiglu_reference,
        doc="SwiGLU on the fused [gate | up] fc1 output, fp32 math",
        cases=_swiglu_cases,
        bench_case=lambda dtype, device: Case(
            "4096x2x1024", (torch.randn(4096, 2 * 1024, device=device, dtype=dtype),)
        ),
        naive=_swiglu_naive,
    )
)


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU that keeps only its input for the backward pass.

    Autograd through the reference keeps the (upcast) input and ``silu(gate)``: three times
    the input's memory in half precision, 1.5 times in fp32. Here only the input is kept; the
    backward recomputes from it ``d up = g * silu(gate)`` and ``d gate = g * up * silu'(gate)``
    (torch's fused ``silu_backward``), writing both halves straight into the input gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(x)
        half = x.shape[-1] // 2
        # Only the gate is upcast; multiplying the fp32 silu by ``up`` in place promotes it
        # element by element (exact), so no fp32 copy of ``up`` and no extra product buffer.
        return F.silu(_upcast(x[..., :half])).mul_(x[..., half:]).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:  # noqa: D102
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        gate, up = _upcast(x[..., :half]), x[..., half:]  # grad * up promotes up on the fly
        grad = _upcast(grad_out)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        # out= casts the fp32 results of half-precision inputs on the way into grad_x.
        torch.mul(grad, F.silu(gate), out=grad_x[..., half:])
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_x[..., :half])
        return grad_x


# Not traceable: its backward writes into views of the gradient with ``out=`` (the reference runs under compile).
@register_kernel("swiglu", "native", priority=5, traceable=False)
def swiglu_native(x: torch.Tensor) -> torch.Tensor:
    """The reference's math with a backward that saves only ``x`` (see :class:`SwiGLUFunction`)."""
    check_swiglu_input(x)
    return SwiGLUFunction.apply(x)
