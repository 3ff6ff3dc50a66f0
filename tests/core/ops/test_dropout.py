"""``sparse_dropout``: i.i.d. Bernoulli(p) drops, drawn from the torch generator, the same
masks in the backward, and ``F.dropout``'s contract (scale 1 / (1 - p), identity off training)."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed.ops.dropout import dropped_positions, sparse_dropout


@pytest.mark.parametrize("p", [0.001, 0.05, 0.3, 0.5])
def test_drop_rate_and_independence(p: float) -> None:
    torch.manual_seed(0)
    n = 2_000_000
    positions = dropped_positions(n, p)
    assert positions.dtype == torch.int64 and bool((positions.diff() > 0).all())
    assert 0 <= int(positions[0]) and int(positions[-1]) < n
    # The drop count is Binomial(n, p): within 5 standard deviations.
    assert abs(positions.numel() - n * p) < 5 * math.sqrt(n * p * (1 - p))
    # Gaps are geometric (memoryless): P(gap = 1) = p, like neighbouring Bernoulli draws.
    gaps = positions.diff()
    share = float((gaps == 1).float().mean())
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / gaps.numel()) + 1e-9


def test_forward_backward_same_mask_and_scale() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 3, 97, requires_grad=True)
    y = sparse_dropout(x, 0.1)
    kept = y != 0
    torch.testing.assert_close(y[kept], x.detach()[kept] / 0.9)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.9))


def test_seeded_like_torch_generator() -> None:
    x = torch.randn(1000, 50)
    torch.manual_seed(7)
    a = sparse_dropout(x, 0.05)
    torch.manual_seed(7)
    b = sparse_dropout(x, 0.05)
    assert torch.equal(a, b)
    # A forked generator state (what megatron's RNG tracker swaps in) gives other masks.
    assert not torch.equal(sparse_dropout(x, 0.05), a)


def test_identity_and_fallback() -> None:
    x = torch.randn(10, 10)
    assert sparse_dropout(torch.empty(0, 4), 0.1).shape == (0, 4)
    assert sparse_dropout(x, 0.0) is x
    assert sparse_dropout(x, 0.3, training=False) is x
    torch.manual_seed(3)
    high = sparse_dropout(x, 0.9)  # above MAX_SPARSE_P: torch's own dropout
    torch.manual_seed(3)
    assert torch.equal(high, torch.nn.functional.dropout(x, 0.9, training=True))
