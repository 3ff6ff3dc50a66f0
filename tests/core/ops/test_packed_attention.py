"""Packed (cu_seqlens) attention on SDPA: the segment-wise path against the dense block-diagonal
mask and the fp32 reference, outputs and gradients, and the choice between the two paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindspeed.ops import attention as attention_module
from mindspeed.ops.attention import attention_reference, attention_sdpa

PACKINGS = {
    "one segment": [0, 12],
    "equal": [0, 4, 8, 12, 16],
    "unequal": [0, 1, 3, 10, 11, 19, 24],
    "empty segment": [0, 4, 4, 9, 12],
    # Trailing padding of a packed micro batch is one more segment (it attends only to itself).
    "trailing padding": [0, 7, 10, 17],
    "many tiny": list(range(0, 41, 2)) + [45],
}
MASKS = {
    "causal": {"causal": True},
    "full": {"causal": False},
    "sliding window": {"causal": True, "window_size": (2, 0)},
    # Wider than the shorter segments (dropped there) and narrower than the longest.
    "wide window": {"causal": True, "window_size": (6, 0)},
    "band": {"causal": False, "window_size": (1, 2)},
    "left only": {"causal": False, "window_size": (0, -1)},
    "right bound 0": {"causal": False, "window_size": (-1, 0)},  # causal by another name
}


def _qkv(seq: int, heads_q: int, heads_kv: int, dim: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads_q, dim, generator=gen)
    k, v = (torch.randn(1, seq, heads_kv, dim, generator=gen) for _ in range(2))
    return tuple(x.to(dtype) for x in (q, k, v))


def _run(fn, qkv, cu: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """Output and the gradients of q, k, v for a fixed random cotangent."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in qkv)
    out = fn(q, k, v, cu_seqlens=cu, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _force(monkeypatch: pytest.MonkeyPatch, *, dense: bool = False, call_cost: float | None = None) -> None:
    # The cost model's constants: a dense weight of 0 never beats the estimate, a huge one always.
    monkeypatch.setattr(attention_module, "_DENSE_COST", 0.0 if dense else 1e30)
    if call_cost is not None:
        monkeypatch.setattr(attention_module, "_CALL_COST", call_cost)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_segmented_equals_dense_and_reference(packing: str, mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = PACKINGS[packing]
    cu = torch.tensor(bounds, dtype=torch.int32)
    # Grouped-query attention on half the packings, plain multi-head on the others.
    heads_q, heads_kv = (4, 2) if list(PACKINGS).index(packing) % 2 == 0 else (3, 3)
    qkv = _qkv(bounds[-1], heads_q, heads_kv)
    kwargs = dict(MASKS[mask], softmax_scale=0.45)
    expected = _run(attention_reference, qkv, cu, **kwargs)
    _force(monkeypatch, dense=True)
    dense = _run(attention_sdpa, qkv, cu, **kwargs)
    # A zero call cost groups only equal lengths (many SDPA calls); a huge one pads all into one.
    for call_cost in (0, 1 << 40):
        _force(monkeypatch, call_cost=call_cost)
        segmented = _run(attention_sdpa, qkv, cu, **kwargs)
        for name, got, want, ref in zip(("out", "dq", "dk", "dv"), segmented, dense, expected):
            assert torch.isfinite(got).all(), name
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} vs dense: {m}")
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} vs reference: {m}")


@pytest.mark.parametrize("mask", ["causal", "sliding window"])
def test_segmented_bf16_close_to_dense(mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = PACKINGS["unequal"]
    cu = torch.tensor(bounds, dtype=torch.int32)
    qkv = _qkv(bounds[-1], 4, 2, dim=16, dtype=torch.bfloat16, seed=1)
    _force(monkeypatch, dense=True)
    dense = _run(attention_sdpa, qkv, cu, **MASKS[mask])
    _force(monkeypatch, call_cost=0)
    segmented = _run(attention_sdpa, qkv, cu, **MASKS[mask])
    for got, want in zip(segmented, dense):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def _spy_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append({"q": tuple(q.shape), "mask": None if attn_mask is None else tuple(attn_mask.shape), **kwargs})
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_segments_batch_by_length_with_is_causal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lengths 9, 9, 8 | 3, 2, 1 with a call cost of 20 score elements: padding 8 to 9 costs
    # 81 - 64 = 17 and joins, 3 to 9 costs 72 and opens a group; 2 and 1 cost 5 and 8 there.
    bounds = [0, 9, 12, 21, 23, 31, 32]
    q, k, v = _qkv(bounds[-1], 4, 2)
    monkeypatch.setattr(attention_module, "_CALL_COST", 20 * 4 * 8)  # per heads_q * dim
    calls = _spy_sdpa(monkeypatch)
    attention_sdpa(q, k, v, cu_seqlens=torch.tensor(bounds))
    assert [(c["q"], c["mask"], c["is_causal"]) for c in calls] == [
        ((3, 4, 9, 8), None, True),
        ((3, 4, 3, 8), None, True),
    ]
    # A window of 8 tokens hides keys only in the group of 9s, and the 8 there is padded.
    calls.clear()
    attention_sdpa(q, k, v, cu_seqlens=torch.tensor(bounds), window_size=(7, 0))
    assert [(c["q"], c["mask"], c["is_causal"]) for c in calls] == [
        ((3, 4, 9, 8), (3, 1, 9, 9), False),
        ((3, 4, 3, 8), None, True),
    ]


def test_dense_mask_where_it_is_estimated_cheaper(monkeypatch: pytest.MonkeyPatch) -> None:
    # With calls priced far above the whole row's score matrix, one dense masked call wins.
    bounds = [0, 3, 5, 6]
    q, k, v = _qkv(bounds[-1], 2, 2)
    monkeypatch.setattr(attention_module, "_CALL_COST", 1 << 30)
    calls = _spy_sdpa(monkeypatch)
    attention_sdpa(q, k, v, cu_seqlens=torch.tensor(bounds))
    assert [(c["q"], c["mask"]) for c in calls] == [((1, 2, 6, 8), (6, 6))]


def test_default_cost_model_takes_segments_for_the_grpo_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GRPO micro batch of docs/rl/benchmark.md: 8 sequences of ~82 tokens, 8 heads of 32.
    lengths = [70, 75, 80, 82, 84, 88, 90, 87]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q, k, v = _qkv(bounds[-1], 8, 4, dim=32)
    calls = _spy_sdpa(monkeypatch)
    attention_sdpa(q, k, v, cu_seqlens=torch.tensor(bounds))
    assert calls and all(c["mask"] is None and c["is_causal"] for c in calls)
    assert sum(c["q"][0] for c in calls) == len(lengths)
