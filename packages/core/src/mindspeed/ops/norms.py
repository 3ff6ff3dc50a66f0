"""Normalisation ops: ``rms_norm`` and ``layer_norm``.

Both normalise over the last dimension, compute their statistics in fp32 whatever the input
dtype (as Megatron and the Hugging Face models do) and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Args:
        x: ``[..., hidden]``.
        weight: ``[hidden]`` or ``None`` (no affine scale).
        eps: added to the mean square.
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased variance).

    Args:
        x: ``[..., hidden]``.
        weight: ``[hidden]`` or ``None``.
        bias: ``[hidden]`` or ``None``.
        eps: added to the variance.
    """
    x32 = x.float()
    mean = x32.mean(dim=-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (x32 - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _norm_cases(dtype: torch.dtype, device: torch.device, with_bias: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(shape: tuple[int, ...], affine: bool = True) -> tuple:
        hidden = shape[-1]
        x = torch.randn(shape, generator=gen).to(device, dtype)
        weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype) if affine else None
        bias = (0.1 * torch.randn(hidden, generator=gen)).to(device, dtype) if affine else None
        return (x, weight, bias) if with_bias else (x, weight)

    return [
        Case("2d", make((16, 64))),
        Case("3d odd hidden", make((3, 7, 33))),
        Case("4d", make((2, 3, 5, 128))),
        Case("no affine", make((4, 96), affine=False)),
    ]


def _rms_norm_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = _norm_cases(dtype, device, with_bias=False)
    return cases + [Case("large eps", cases[0].args, {"eps": 1e-2})]


def _layer_norm_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    cases = _norm_cases(dtype, device, with_bias=True)
    return cases + [Case("large eps", cases[0].args, {"eps": 1e-2})]


def _bench(dtype: torch.dtype, device: torch.device, with_bias: bool) -> Case:
    x = torch.randn(4096, 4096, device=device, dtype=dtype)
    weight = torch.ones(4096, device=device, dtype=dtype)
    bias = torch.zeros(4096, device=device, dtype=dtype)
    return Case("4096x4096", (x, weight, bias) if with_bias else (x, weight))


def _rms_norm_naive(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Naive version: every intermediate materialised in the input dtype."""
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


_FP32 = {torch.float32: Tolerance(atol=1e-5, rtol=1e-5)}

register_op(
    OpSpec(
        name="rms_norm",
        reference=rms_norm_reference,
        doc="RMSNorm over the last dimension, fp32 statistics",
        cases=_rms_norm_cases,
        bench_case=lambda dtype, device: _bench(dtype, device, with_bias=False),
        naive=_rms_norm_naive,
        tolerances=_FP32,
    )
)
register_op(
    OpSpec(
        name="layer_norm",
        reference=layer_norm_reference,
        doc="LayerNorm over the last dimension, fp32 statistics",
        cases=_layer_norm_cases,
        bench_case=lambda dtype, device: _bench(dtype, device, with_bias=True),
        tolerances=_FP32,
    )
)


@register_kernel("rms_norm", "native", priority=5)
def rms_norm_native(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """torch's own ``F.rms_norm`` (a fused kernel on CUDA), with the reference's fp32 statistics."""
    hidden = x.shape[-1]
    if x.dtype == torch.float32:
        return F.rms_norm(x, (hidden,), weight, eps)
    # Half-precision inputs: normalise in fp32 like the reference, then cast back.
    w = None if weight is None else weight.float()
    return F.rms_norm(x.float(), (hidden,), w, eps).to(x.dtype)


@register_kernel("layer_norm", "native", priority=5)
def layer_norm_native(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """torch's own ``F.layer_norm`` (fused on every device torch supports)."""
    hidden = x.shape[-1]
    if x.dtype == torch.float32:
        return F.layer_norm(x, (hidden,), weight, bias, eps)
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (hidden,), w, b, eps).to(x.dtype)
