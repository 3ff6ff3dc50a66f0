"""swiglu: the reference against the closed form, the native backward against finite differences."""

from __future__ import annotations

import pytest
import torch

from mindspeed.ops.activations import swiglu_native, swiglu_reference


def _closed_form(x: torch.Tensor) -> torch.Tensor:
    """``gate / (1 + exp(-gate)) * up`` in float64, halves taken by explicit slicing."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].double(), x[..., half:].double()
    return gate / (1.0 + torch.exp(-gate)) * up


def test_reference_matches_closed_form() -> None:
    x = torch.randn(3, 5, 2 * 7, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(swiglu_reference(x).double(), _closed_form(x), atol=1e-6, rtol=1e-6)


def test_reference_computes_half_precision_in_fp32() -> None:
    # Rounded once at the end: equal to the exact value rounded to bf16 (up to ties), which an
    # all-bf16 computation (three roundings) is not.
    x = (torch.randn(64, 2 * 96, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    out = swiglu_reference(x)
    assert out.dtype == torch.bfloat16 and out.shape == (64, 96)
    exact = _closed_form(x)
    mismatched = (out != exact.to(torch.bfloat16)).float().mean().item()
    assert mismatched < 0.01, mismatched
    gate, up = x.chunk(2, dim=-1)
    naive = torch.nn.functional.silu(gate) * up
    assert (out.double() - exact).abs().sum() < (naive.double() - exact).abs().sum()


def test_native_backward_matches_finite_differences() -> None:
    x = torch.randn(4, 2 * 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    assert torch.autograd.gradcheck(swiglu_native, (x.requires_grad_(),))


def test_native_backward_in_bf16_matches_reference() -> None:
    x = torch.randn(8, 2 * 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    cotangent = torch.randn(8, 16).bfloat16()
    grads = []
    for fn in (swiglu_reference, swiglu_native):
        leaf = x.clone().requires_grad_()
        fn(leaf).backward(cotangent)
        assert leaf.grad.dtype == torch.bfloat16
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-2, rtol=1e-2)


def _saved_numel(fn, x: torch.Tensor) -> int:
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x.clone().requires_grad_())
    return sum(saved)


def test_native_saves_only_its_input() -> None:
    x = torch.randn(16, 2 * 32).bfloat16()
    input_bytes = x.numel() * x.element_size()
    assert _saved_numel(swiglu_native, x) == input_bytes
    assert _saved_numel(swiglu_reference, x) >= 3 * input_bytes  # fp32 input copy and silu(gate)


@pytest.mark.parametrize("fn", [swiglu_reference, swiglu_native])
def test_odd_last_dimension_is_rejected(fn) -> None:
    with pytest.raises(ValueError, match="must be even"):
        fn(torch.randn(3, 7))


def test_matches_megatron_swiglu_and_its_backward() -> None:
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_swiglu")
    x = torch.randn(6, 2 * 24, generator=torch.Generator().manual_seed(4))
    g = torch.randn(6, 24, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(swiglu_reference(x), fused.swiglu(x))
    leaf = x.clone().requires_grad_()
    swiglu_native(leaf).backward(g)
    torch.testing.assert_close(leaf.grad, fused.swiglu_back(g, x))
