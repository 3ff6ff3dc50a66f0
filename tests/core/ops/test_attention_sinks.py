"""Attention sinks (GPT-OSS): the op's ``sinks`` against an explicit softmax with a sink column.

The explicit form is transformers' eager GPT-OSS attention: append the per-head sink logit as
one more column of the scores, softmax, drop the column, multiply by ``v``. Forward and the
gradients of q, k, v and the sinks are compared; so is :func:`apply_sinks` (what the flash-attn
and NPU backends use on their log-sum-exp), and the SDPA backend (which falls back).
"""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed.ops.attention import apply_sinks, attention_reference, attention_sdpa, visible_keys_mask


def explicit_sink_attention(q, k, v, sinks, *, causal=True, window_size=(-1, -1)):
    """softmax([scores, sink])[..., :-1] @ v in float64, with a mask from index arithmetic."""
    b, sq, n, d = q.shape
    group = n // k.shape[2]
    q64, k64, v64 = (x.double().transpose(1, 2) for x in (q, k, v))
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(d)
    mask = visible_keys_mask(sq, k.shape[1], causal=causal, window_size=window_size)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.double().view(1, n, 1, 1).expand(b, n, sq, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return (probs @ v64).transpose(1, 2)


CASES = {
    "gqa causal": ((2, 9, 9, 4, 2, 16), {}),
    "window": ((1, 12, 12, 4, 1, 8), {"window_size": (3, 0)}),
    "decode sq<sk": ((2, 3, 10, 4, 2, 16), {}),
    "full": ((1, 6, 6, 2, 2, 8), {"causal": False}),
}


def _inputs(dims, seed=0):
    b, sq, sk, n, nkv, d = dims
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(b, sq, n, d, generator=gen), torch.randn(b, sk, nkv, d, generator=gen)]
    tensors += [torch.randn(b, sk, nkv, d, generator=gen), 2 * torch.randn(n, generator=gen)]
    return [t.requires_grad_(True) for t in tensors]


def _forward_backward(fn, inputs):
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), inputs)
    return out.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_sinks_match_explicit_softmax(name: str) -> None:
    dims, kwargs = CASES[name]
    inputs = _inputs(dims)
    want, want_grads = _forward_backward(lambda q, k, v, s: explicit_sink_attention(q, k, v, s, **kwargs), inputs)

    def through_lse(q, k, v, s):  # the flash-attn / NPU route: plain attention, then the sink
        out, lse = attention_reference(q, k, v, return_lse=True, **kwargs)
        return apply_sinks(out, lse, s)

    variants = {
        "reference": lambda q, k, v, s: attention_reference(q, k, v, sinks=s, **kwargs),
        "apply_sinks": through_lse,
        "sdpa (falls back)": lambda q, k, v, s: attention_sdpa(q, k, v, sinks=s, **kwargs),
    }
    for label, fn in variants.items():
        got, grads = _forward_backward(fn, inputs)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5, msg=f"{label} forward")
        for what, g, w in zip("qkv" + "s", grads, want_grads):
            torch.testing.assert_close(g.double(), w.double(), atol=2e-5, rtol=2e-5, msg=f"{label} d{what}")
    # The sink takes probability away: output shrinks towards 0 against attention without it.
    plain = attention_reference(*inputs[:3], **kwargs)
    assert not torch.allclose(plain, want.float(), atol=1e-3)


def test_sinks_lse_is_the_keys_alone_and_bad_shape_is_refused() -> None:
    q, k, v, s = _inputs((1, 5, 5, 2, 2, 8))
    _, lse_plain = attention_reference(q, k, v, return_lse=True)
    _, lse_sinks = attention_reference(q, k, v, return_lse=True, sinks=s)
    torch.testing.assert_close(lse_sinks, lse_plain)
    with pytest.raises(ValueError, match="one logit per query head"):
        attention_reference(q, k, v, sinks=torch.zeros(3))
