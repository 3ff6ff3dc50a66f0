"""The shared attention mask: layers attending with the same lengths and ``cu_seqlens`` build it once."""

from __future__ import annotations

import pytest
import torch

from mindspeed.ops import KERNELS, mask_cache
from mindspeed.ops.alibi import get_alibi_slopes

LAYERS = 4


@pytest.fixture(autouse=True)
def fresh_cache():
    mask_cache.clear_masks()
    yield
    mask_cache.clear_masks()


def _layers(kernel, q, **kwargs) -> list[torch.Tensor]:
    """One call per layer, as megatron's layers make them (the same mask arguments)."""
    return [kernel(q, q, q, **kwargs) for _ in range(LAYERS)]


@pytest.mark.parametrize(
    ("impl", "seq", "kwargs"),
    [
        ("sdpa", 12, {"cu_seqlens": "packed"}),  # short: the plan says a dense mask
        ("sdpa", 200, {"cu_seqlens": "packed"}),  # long: the segment-wise plan (gathers and masks)
        ("sdpa", 12, {"window_size": (3, 0)}),  # a dense window mask
        ("sdpa", 12, {"cu_seqlens": "packed", "alibi_slopes": get_alibi_slopes(4)}),  # the ALiBi bias
        ("reference", 12, {"cu_seqlens": "packed"}),
    ],
)
def test_one_construction_for_all_layers(impl: str, seq: int, kwargs: dict) -> None:
    kernel = KERNELS.get(("attention", impl))
    q = torch.randn(1, seq, 4, 8)
    cu = torch.tensor([0, seq // 2 - 1, seq], dtype=torch.int32)
    kwargs = {k: cu if v == "packed" else v for k, v in kwargs.items()}
    kernel(q, q, q, **kwargs)
    per_layer = mask_cache.stats["built"]  # what one layer builds (a packed plan may also build a dense mask)
    assert per_layer >= 1
    outs = _layers(kernel, q, **kwargs)
    assert mask_cache.stats["built"] == per_layer, "the other layers rebuilt the mask"
    assert mask_cache.stats["reused"] == per_layer * LAYERS
    mask_cache.clear_masks()
    torch.testing.assert_close(kernel(q, q, q, **kwargs), outs[-1], atol=0, rtol=0)  # reuse changes nothing
    if "cu_seqlens" in kwargs:
        # The next microbatch (a new tensor) replaces the last one's masks; none is kept alive.
        following = torch.tensor([0, 7, seq], dtype=torch.int32)
        changed = kernel(q, q, q, **{**kwargs, "cu_seqlens": following})
        assert not any(t is cu for tensors, _, _ in mask_cache._entries.values() for t in tensors)
        mask_cache.clear_masks()
        expected = kernel(q, q, q, **{**kwargs, "cu_seqlens": following.clone()})
        torch.testing.assert_close(changed, expected, atol=0, rtol=0)
        assert not torch.allclose(changed, outs[-1])
        # An in-place change of the same tensor is seen too (its version counter moves).
        built = mask_cache.stats["built"]
        following[1] = 3
        kernel(q, q, q, **{**kwargs, "cu_seqlens": following})
        assert mask_cache.stats["built"] > built
