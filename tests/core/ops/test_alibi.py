"""ALiBi in the attention op against an explicit bias: transformers' BLOOM ``build_alibi_tensor``
(slopes and the causal bias), forward and backward in fp32, for power-of-two and other head counts."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from mindspeed.ops import KERNELS
from mindspeed.ops.alibi import get_alibi_slopes, shard_alibi_slopes
from mindspeed.ops.attention import attention_reference

IMPLS = ("reference", "sdpa")


def test_slopes_are_blooms_for_every_head_count() -> None:
    for heads in range(1, 41):
        # BLOOM's bias is slope * key position: position 1 holds the slopes. BLOOM raises an fp32
        # base to a power (up to 5e-7 off at 40 heads); ours are the exact powers of two, rounded once.
        blooms = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
        torch.testing.assert_close(get_alibi_slopes(heads), blooms, atol=0, rtol=1e-6, msg=f"{heads} heads")
    # The paper's 8 heads: 1/2, 1/4, ..., 1/256.
    assert get_alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]


def test_tensor_parallel_ranks_take_their_heads_slopes() -> None:
    full = get_alibi_slopes(12)
    shards = [shard_alibi_slopes(12, rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat(shards), full) and all(s.shape == (4,) for s in shards)
    with pytest.raises(ValueError, match="tensor-parallel size must divide"):
        shard_alibi_slopes(12, 0, 5)
    with pytest.raises(ValueError, match="positive integer"):
        get_alibi_slopes(0)


def _explicit(q, k, v, bias: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with hidden keys at -inf, [b, s, n, d] in and out."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scores = qt @ kt.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vt).transpose(1, 2)


def _grads(out: torch.Tensor, inputs: tuple, probe: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * probe).sum(), inputs))


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_causal_alibi_equals_blooms_explicit_bias(heads: int) -> None:
    torch.manual_seed(heads)
    batch, seq, dim = 2, 11, 8
    q, k, v = (torch.randn(batch, seq, heads, dim, requires_grad=True) for _ in range(3))
    probe = torch.randn(batch, seq, heads, dim)
    # transformers' [b * n, 1, s] bias (slope * key position), broadcast over the queries.
    bias = build_alibi_tensor(torch.ones(batch, seq), heads, torch.float32).view(batch, heads, 1, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    expected = _explicit(q, k, v, bias, causal)
    expected_grads = _grads(expected, (q, k, v), probe)
    for impl in IMPLS:
        out = KERNELS.get(("attention", impl))(q, k, v, causal=True, alibi_slopes=get_alibi_slopes(heads))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=impl)
        for got, want in zip(_grads(out, (q, k, v), probe), expected_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=impl)


def test_bidirectional_and_packed_alibi_use_the_distance_inside_each_segment() -> None:
    torch.manual_seed(0)
    heads, seq, dim = 5, 9, 8
    q, k, v = (torch.randn(1, seq, heads, dim) for _ in range(3))
    slopes = get_alibi_slopes(heads)
    pos = torch.arange(seq)
    bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
    everything = torch.ones(seq, seq, dtype=torch.bool)
    expected = _explicit(q, k, v, bias, everything)
    bounds = torch.tensor([0, 4, 9], dtype=torch.int32)
    for impl in IMPLS:
        kernel = KERNELS.get(("attention", impl))
        out = kernel(q, k, v, causal=False, alibi_slopes=slopes)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=impl)
        # Packed: every segment as if it ran alone.
        packed = kernel(q, k, v, causal=True, alibi_slopes=slopes, cu_seqlens=bounds)
        alone = [attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], alibi_slopes=slopes) for a, b in ((0, 4), (4, 9))]
        torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=1e-5, msg=impl)


def test_bad_slopes_raise() -> None:
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="one slope per query head"):
        attention_reference(q, q, q, alibi_slopes=get_alibi_slopes(4))
