"""matmul_add_fp32: the reference against a per-token sum of outer products in float64."""

from __future__ import annotations

import types

import pytest
import torch

from mindspeed.ops.matmul_add import matmul_add_fp32_native, matmul_add_fp32_reference


def _inputs(tokens: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    g = torch.randn(tokens, out_features, generator=gen).to(dtype)
    main_grad = torch.randn(out_features, in_features, generator=gen)
    return x, g, main_grad


def _outer_product_sum(x: torch.Tensor, g: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """``main_grad + sum_n outer(g[n], x[n])``, token by token, in float64."""
    expected = main_grad.double().clone()
    for n in range(x.shape[0]):
        expected += torch.outer(g[n].double(), x[n].double())
    return expected


def test_reference_matches_outer_product_sum_in_place() -> None:
    x, g, main_grad = _inputs(29, 13, 11, torch.float32)
    expected = _outer_product_sum(x, g, main_grad)
    out = matmul_add_fp32_reference(x, g, main_grad)
    assert out is main_grad
    torch.testing.assert_close(main_grad.double(), expected, atol=1e-5, rtol=1e-5)


def test_three_dimensional_inputs_fold_their_leading_dims() -> None:
    x, g, main_grad = _inputs(4 * 3, 10, 6, torch.float32, seed=1)
    expected = _outer_product_sum(x, g, main_grad)
    matmul_add_fp32_reference(x.reshape(4, 3, 10), g.reshape(4, 3, 6), main_grad)
    torch.testing.assert_close(main_grad.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [matmul_add_fp32_reference, matmul_add_fp32_native])
def test_half_precision_products_are_accumulated_in_fp32(fn) -> None:
    # 512 tokens of bf16 inputs: exact in fp32 up to summation order, while a bf16 product
    # (Megatron's unfused path) is off by bf16 rounding of every entry.
    x, g, main_grad = _inputs(512, 24, 16, torch.bfloat16, seed=2)
    expected = _outer_product_sum(x, g, main_grad)
    unfused = main_grad.double() + (g.t() @ x).double()
    fn(x, g, main_grad)
    assert main_grad.dtype == torch.float32
    error = (main_grad.double() - expected).abs().max().item()
    assert error < 1e-4, error
    assert error < (unfused - expected).abs().max().item() / 100


def test_accumulates_over_several_micro_batches() -> None:
    main_grad = torch.zeros(5, 7)
    expected = torch.zeros(5, 7, dtype=torch.float64)
    for seed in range(3):
        x, g, _ = _inputs(9, 7, 5, torch.float32, seed=seed)
        matmul_add_fp32_reference(x, g, main_grad)
        expected = _outer_product_sum(x, g, expected)
    torch.testing.assert_close(main_grad.double(), expected, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_rejected() -> None:
    x, g, main_grad = _inputs(8, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        matmul_add_fp32_reference(x, g, main_grad.bfloat16())
    with pytest.raises(ValueError, match="fp32"):
        matmul_add_fp32_reference(x, g, main_grad.t())
    with pytest.raises(ValueError, match="token"):
        matmul_add_fp32_reference(x[:7], g, main_grad)


def test_npu_wrapper_argument_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The npu wrapper with the fused op replaced by its documented ``C += x^T @ weight``."""
    from mindspeed.ops.backends import npu_basic

    calls: list[torch.dtype] = []

    def npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> None:
        assert c.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
        calls.append(x.dtype)
        c.add_(x.double().t().matmul(weight.double()).float())

    fake = types.SimpleNamespace(npu_matmul_add_fp32=npu_matmul_add_fp32)
    monkeypatch.setattr("mindspeed.ops.backends.npu_basic.import_torch_npu", lambda: fake)
    npu_basic._matmul_add_op.cache_clear()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            x, g, main_grad = _inputs(24, 12, 20, dtype, seed=3)
            # Non-contiguous [s, b, h] views, as a transposed layer input would be.
            x, g = x.reshape(4, 6, 12).transpose(0, 1), g.reshape(4, 6, 20).transpose(0, 1)
            expected = matmul_add_fp32_reference(x, g, main_grad.clone())
            npu_basic.matmul_add_fp32_npu(x, g, main_grad)
            torch.testing.assert_close(main_grad, expected, atol=1e-5, rtol=1e-5)
        x, g, main_grad = _inputs(0, 3, 2, torch.bfloat16)
        before = main_grad.clone()
        npu_basic.matmul_add_fp32_npu(x, g, main_grad)
        assert torch.equal(main_grad, before)
    finally:
        npu_basic._matmul_add_op.cache_clear()
    assert calls == [torch.bfloat16]  # fp32 inputs and empty inputs do not reach the kernel
