"""NF4 quantisation: the reference against an independent nearest-value implementation, packing,
double quantisation, odd sizes, error bounds and the storage ratio.

The generic parity test (test_parity.py) compares every backend (bitsandbytes on a CUDA host)
with the reference; this file proves the reference itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed.ops import KERNELS, list_kernels, resolve_kernel
from mindspeed.ops.quant import NF4_VALUES, dynamic_map_8bit, nf4_dequantize_reference, nf4_quantize_reference

NF4 = torch.tensor(NF4_VALUES)


def _nearest(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest table value, by brute force over every value."""
    return (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1)


def _blockwise(flat: torch.Tensor, block: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax and nearest codes, block by block in a Python loop."""
    codes, maxima = [], []
    for start in range(0, flat.numel(), block):
        part = flat[start : start + block]
        amax = part.abs().max()
        maxima.append(amax)
        scaled = part * (1.0 / amax) if amax > 0 else torch.zeros_like(part)
        codes.append(_nearest(scaled, table))
    return torch.cat(codes), torch.stack(maxima)


def _independent(weight: torch.Tensor, block: int = 64, double: bool = True, block2: int = 256) -> dict:
    flat = weight.reshape(-1).float()
    codes, absmax = _blockwise(flat, block, NF4)
    if codes.numel() % 2:
        codes = torch.cat([codes, torch.tensor([7])])  # 7 is the index of 0.0
    packed = torch.tensor([int(hi) * 16 + int(lo) for hi, lo in zip(codes[0::2], codes[1::2])], dtype=torch.uint8)
    out = {"codes": packed, "absmax": absmax}
    if double:
        offset = absmax.sum() / absmax.numel()
        qmax, scales = _blockwise(absmax - offset, block2, dynamic_map_8bit())
        out.update(absmax=qmax.to(torch.uint8), absmax_scale=scales, absmax_offset=offset)
    return out


def _dequantize(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return nf4_dequantize_reference(q.codes, q.absmax, q.shape, dtype, **q.dequantize_kwargs())


@pytest.mark.parametrize("shape", [(64, 128), (7, 37), (1000,), (3,)], ids=str)
@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_quantize_equals_independent_nearest_value(shape: tuple, double: bool) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * torch.linspace(
        0.01, 3.0, math.prod(shape)
    ).view(shape)
    q = nf4_quantize_reference(weight, double_quant=double)
    want = _independent(weight, double=double)
    assert torch.equal(q.codes, want["codes"])
    if double:
        assert torch.equal(q.absmax, want["absmax"])
        torch.testing.assert_close(q.absmax_scale, want["absmax_scale"], rtol=0, atol=0)
        torch.testing.assert_close(q.absmax_offset, want["absmax_offset"], rtol=1e-6, atol=0)
    else:
        assert q.absmax_scale is None and q.absmax_offset is None
        torch.testing.assert_close(q.absmax, want["absmax"], rtol=0, atol=0)
    # Dequantisation by hand: unpack, look up, scale by the (dequantised) block maxima.
    codes = torch.stack([want["codes"] // 16, want["codes"] % 16], dim=1).reshape(-1)[: weight.numel()].long()
    maxima = want["absmax"].float()
    if double:
        blocks = torch.arange(maxima.numel()) // 256
        maxima = dynamic_map_8bit()[want["absmax"].long()] * want["absmax_scale"][blocks] + want["absmax_offset"]
    by_hand = NF4[codes] * maxima[torch.arange(weight.numel()) // 64]
    torch.testing.assert_close(_dequantize(q), by_hand.view(shape), rtol=1e-6, atol=1e-7)


def test_dequantised_weight_is_within_the_nf4_error_bound() -> None:
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(2)) * 0.02
    half_gap = (NF4[1:] - NF4[:-1]).max().item() / 2  # 0.152: between -1 and the next value
    for double in (False, True):
        q = nf4_quantize_reference(weight, double_quant=double)
        err = (_dequantize(q) - weight).abs().view(-1, 64)
        absmax = weight.abs().view(-1, 64).amax(dim=1)
        got_absmax = _dequantize(q).abs().view(-1, 64).amax(dim=1)
        absmax_err = (got_absmax - absmax).abs()
        assert (err <= half_gap * absmax.unsqueeze(1) + absmax_err.unsqueeze(1) + 1e-7).all()
        # Double quantisation moves a block maximum by well under 1% of the maxima's spread.
        assert absmax_err.max() <= (0.0 if not double else 0.01 * absmax.max().item())
        # Relative to the weights, NF4 of a Gaussian is ~10% RMS error per block.
        rel = ((_dequantize(q) - weight).norm() / weight.norm()).item()
        assert 0.02 < rel < 0.12, rel


def test_packing_two_codes_per_byte_high_nibble_first() -> None:
    indices = torch.tensor([15, 0, 3, 12, 7, 7, 9, 1] * 8)  # one block of 64, its max is index 15 (1.0)
    weight = NF4[indices] * 2.0  # exactly representable: quantising must give the indices back
    q = nf4_quantize_reference(weight, double_quant=False)
    assert q.codes.tolist()[:4] == [15 * 16 + 0, 3 * 16 + 12, 7 * 16 + 7, 9 * 16 + 1]
    assert q.absmax.tolist() == [2.0]
    assert torch.equal(_dequantize(q), weight)


def test_odd_sizes_quantise_their_last_partial_block() -> None:
    weight = torch.randn(7, 37, generator=torch.Generator().manual_seed(3))  # 259 values: 4 blocks + 3
    q = nf4_quantize_reference(weight, double_quant=False)
    assert q.codes.numel() == 130 and q.absmax.numel() == 5
    assert q.codes[-1].item() & 0xF == 7, "the padding nibble is the code of 0.0"
    assert q.absmax[-1].item() == weight.reshape(-1)[256:].abs().max().item()
    assert _dequantize(q).shape == (7, 37)


def test_bf16_output_is_the_fp32_result_cast_once() -> None:
    weight = torch.randn(33, 64, generator=torch.Generator().manual_seed(4))
    q = nf4_quantize_reference(weight.bfloat16())
    assert torch.equal(_dequantize(q, torch.bfloat16), _dequantize(q).bfloat16())
    # A zero block dequantises to exact zeros, double quantisation notwithstanding.
    zero = nf4_quantize_reference(torch.cat([torch.zeros(64), torch.randn(64)]))
    assert torch.equal(_dequantize(zero)[:64], torch.zeros(64))


def test_storage_is_about_a_quarter_of_bf16() -> None:
    weight = torch.randn(1024, 1024)
    n = weight.numel()
    double, single = nf4_quantize_reference(weight), nf4_quantize_reference(weight, double_quant=False)
    # n/2 code bytes + one byte per 64 values + an fp32 scale per 256 blocks + the offset.
    assert double.nbytes == n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + 4
    assert single.nbytes == n // 2 + 4 * n // 64
    assert 0.25 < double.nbytes / (2 * n) < 0.26
    assert 0.28 < single.nbytes / (2 * n) < 0.29


def test_dynamic_map_is_bitsandbytes_signed_dynamic_type() -> None:
    table = dynamic_map_8bit()
    assert table.numel() == 256 and torch.equal(table, table.sort().values) and table.unique().numel() == 256
    assert table[-1].item() == 1.0 and 0.0 in table.tolist()
    # Decade e (10^-6 .. 10^0) holds 2^e midpoints of equal steps of [0.1, 1], with both signs.
    for e in range(7):
        lo, hi = 10.0 ** (e - 6) * 0.1, 10.0 ** (e - 6)
        assert ((table > lo) & (table < hi)).sum().item() == 2**e
        assert ((table < -lo) & (table > -hi)).sum().item() == 2**e


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="non-empty floating tensor"):
        nf4_quantize_reference(torch.zeros(0))
    with pytest.raises(ValueError, match="non-empty floating tensor"):
        nf4_quantize_reference(torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size=48 is not supported; use one of 32, 64"):
        nf4_quantize_reference(torch.ones(64), block_size=48)
    q = nf4_quantize_reference(torch.randn(128))
    with pytest.raises(ValueError, match="needs 32 uint8 codes and 1 maxima"):
        nf4_dequantize_reference(q.codes, q.absmax, (64,), **q.dequantize_kwargs())
    with pytest.raises(ValueError, match="needs absmax_scale and absmax_offset"):
        nf4_dequantize_reference(q.codes, q.absmax, q.shape)


def test_registry_resolves_the_reference_here_and_lists_bitsandbytes_for_gpus() -> None:
    assert resolve_kernel("nf4_dequantize", "auto", device="cpu").name == "reference"
    assert resolve_kernel("nf4_quantize", "auto", device="cpu").name == "reference"
    bnb = KERNELS.get(("nf4_dequantize", "bitsandbytes"))
    assert bnb.devices == ("cuda",) and [k.name for k in list_kernels("nf4_dequantize")][0] == "bitsandbytes"
    with pytest.raises(ValueError, match="runs on cuda, not on cpu"):
        resolve_kernel("nf4_dequantize", "bitsandbytes", device="cpu")
