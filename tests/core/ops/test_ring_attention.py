"""Folding per-block attention with ring_attention_update equals attention over all keys."""

from __future__ import annotations

import torch

from mindspeed.ops.attention import attention_reference
from mindspeed.ops.ring_attention import ring_attention_update_reference as update


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_(True) for shape in shapes]


def _grads(outputs: list, cotangents: list, leaves: list) -> list[torch.Tensor]:
    return list(torch.autograd.grad(outputs, leaves, cotangents))


def _fold(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = partials[0]
    for cur_out, cur_lse in partials[1:]:
        out, lse = update(out, lse, cur_out, cur_lse)
    return out, lse


def _assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_three_key_blocks_full_gqa() -> None:
    q, k, v = _leaves((2, 5, 6, 8), (2, 12, 2, 8), (2, 12, 2, 8))
    blocks = [slice(0, 4), slice(4, 9), slice(9, 12)]  # uneven on purpose
    partials = [attention_reference(q, k[:, b], v[:, b], causal=False, return_lse=True) for b in blocks]
    out, lse = _fold(partials)
    expected_out, expected_lse = attention_reference(q, k, v, causal=False, return_lse=True)
    _assert_same([out, lse], [expected_out, expected_lse])

    gen = torch.Generator().manual_seed(1)
    cot = [torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)]
    _assert_same(_grads([out, lse], cot, [q, k, v]), _grads([expected_out, expected_lse], cot, [q, k, v]))


def test_causal_ring_over_two_chunks() -> None:
    """Ring attention's causal schedule: earlier key chunks in full, the own chunk causal."""
    q, k, v = _leaves((1, 9, 4, 8), (1, 9, 2, 8), (1, 9, 2, 8), seed=2)
    first, second = slice(0, 5), slice(5, 9)
    out_first, lse_first = attention_reference(q[:, first], k[:, first], v[:, first], return_lse=True)
    out_second, lse_second = _fold(
        [
            attention_reference(q[:, second], k[:, first], v[:, first], causal=False, return_lse=True),
            attention_reference(q[:, second], k[:, second], v[:, second], return_lse=True),
        ]
    )
    out = torch.cat([out_first, out_second], dim=1)
    lse = torch.cat([lse_first, lse_second], dim=2)
    expected_out, expected_lse = attention_reference(q, k, v, return_lse=True)
    _assert_same([out, lse], [expected_out, expected_lse])

    gen = torch.Generator().manual_seed(3)
    cot = [torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)]
    _assert_same(_grads([out, lse], cot, [q, k, v]), _grads([expected_out, expected_lse], cot, [q, k, v]))


def test_decoding_over_a_split_cache() -> None:
    """3 new queries against 10 cached keys: the old block in full, the recent one bottom-right causal."""
    q, k, v = _leaves((1, 3, 2, 8), (1, 10, 1, 8), (1, 10, 1, 8), seed=4)
    old, recent = slice(0, 6), slice(6, 10)
    out, lse = _fold(
        [
            attention_reference(q, k[:, recent], v[:, recent], return_lse=True),
            attention_reference(q, k[:, old], v[:, old], causal=False, return_lse=True),
        ]
    )
    expected_out, expected_lse = attention_reference(q, k, v, return_lse=True)
    _assert_same([out, lse], [expected_out, expected_lse])

    gen = torch.Generator().manual_seed(5)
    cot = [torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)]
    _assert_same(_grads([out, lse], cot, [q, k, v]), _grads([expected_out, expected_lse], cot, [q, k, v]))


def test_rows_without_keys() -> None:
    inf = float("-inf")
    prev_out, cur_out = _leaves((1, 3, 1, 4), (1, 3, 1, 4), seed=6)
    # Row 0: no key on either side; row 1: only cur has keys; row 2: only prev has keys.
    prev_lse = torch.tensor([[[inf, inf, 0.5]]], requires_grad=True)
    cur_lse = torch.tensor([[[inf, 1.5, inf]]], requires_grad=True)
    out, lse = update(prev_out, prev_lse, cur_out, cur_lse)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and torch.isneginf(lse[0, 0, 0])
    torch.testing.assert_close(out[:, 1], cur_out[:, 1])
    torch.testing.assert_close(out[:, 2], prev_out[:, 2])
    torch.testing.assert_close(lse[0, 0, 1:], torch.tensor([1.5, 0.5]))

    cot = [torch.randn(out.shape), torch.randn(lse.shape)]
    grads = _grads([out, lse], cot, [prev_out, prev_lse, cur_out, cur_lse])
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[1][0, 0, 0] == 0 and grads[3][0, 0, 0] == 0  # no gradient into an empty row's lse


def test_update_is_symmetric_and_matches_logaddexp() -> None:
    prev_out, cur_out = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    prev_lse, cur_lse = 3 * torch.randn(2, 3, 5), 3 * torch.randn(2, 3, 5)
    out, lse = update(prev_out, prev_lse, cur_out, cur_lse)
    out_swapped, lse_swapped = update(cur_out, cur_lse, prev_out, prev_lse)
    torch.testing.assert_close(lse, torch.logaddexp(prev_lse, cur_lse))
    torch.testing.assert_close(out, out_swapped)
    torch.testing.assert_close(lse, lse_swapped)
    # Explicit weights, per (b, s, n): softmax over the two blocks' lse.
    weights = torch.softmax(torch.stack([prev_lse, cur_lse]), dim=0).transpose(2, 3).unsqueeze(-1)
    torch.testing.assert_close(out, weights[0] * prev_out + weights[1] * cur_out)


def test_half_precision_output_keeps_dtype() -> None:
    prev_out, cur_out = torch.randn(1, 4, 2, 8).bfloat16(), torch.randn(1, 4, 2, 8).bfloat16()
    out, lse = update(prev_out, torch.randn(1, 2, 4), cur_out, torch.randn(1, 2, 4))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
