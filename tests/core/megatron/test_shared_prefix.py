"""Shared-prefix attention against attention of every ``[prompt, response]`` sequence on its own.

Groups ``[prompt, r_1, ..., r_G]`` with responses of different lengths, a lone pair, and
grouped-query heads: the outputs of the prompt and of every response, and the gradients of the
queries, keys and values (the prompt's summed over its responses), equal the per-sequence
causal attention, for the SDPA kernel and the reference. The end-to-end numbers (rope positions,
log-probs, gradients of a model) are in ``tests/rl/models/test_actor_shared_prompt.py``.
"""

from __future__ import annotations

import pytest
import torch

GROUPS = [(4, (3, 5, 1)), (2, (2,)), (6, (4, 4))]
HEADS, KV_HEADS, DIM = 4, 2, 8


def test_params_number_each_response_after_its_prompt() -> None:
    from mindspeed.megatron.shared_prefix import shared_prefix_params

    params = shared_prefix_params([(3, (2, 1)), (1, (2,))])
    assert params.token_positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2]
    assert params.cu_seqlens_q.tolist() == [0, 6, 9]
    assert params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.groups == ((3, (2, 1)), (1, (2,)))
    with pytest.raises(ValueError, match="non-empty prompt and non-empty responses"):
        shared_prefix_params([(3, ())])


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_shared_prefix_attention_equals_each_sequence_alone(impl: str) -> None:
    from mindspeed.megatron.shared_prefix import attend_shared_prefix, shared_prefix_params
    from mindspeed.ops import resolve_kernel

    kernel = resolve_kernel("attention", impl)
    params = shared_prefix_params(GROUPS)
    total = int(params.cu_seqlens_q[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(total, HEADS, DIM, generator=gen, dtype=torch.float64)
    out = attend_shared_prefix(kernel, q, k, v, params, softmax_scale=0.3)
    (out * weight).sum().backward()
    got = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    q.grad = k.grad = v.grad = None

    # Reference: every [prompt, r_j] on its own; the prompt's output taken from the first.
    want = torch.zeros_like(out)
    loss, start = 0.0, 0
    for prompt, responses in GROUPS:
        head = torch.arange(start, start + prompt)
        offset = start + prompt
        for j, n in enumerate(responses):
            rows = torch.cat([head, torch.arange(offset, offset + n)])
            seq = kernel(q[rows][None], k[rows][None], v[rows][None], causal=True, softmax_scale=0.3)[0]
            keep = rows if j == 0 else rows[prompt:]  # the prompt's output (and loss) once
            part = seq if j == 0 else seq[prompt:]
            want[keep] = part.detach()
            loss = loss + (part * weight[keep]).sum()
            offset += n
        start = offset
    loss.backward()
    # SDPA runs in float64 here; the reference kernel computes in float32 whatever its inputs.
    tol = {"rtol": 1e-10, "atol": 1e-12} if impl == "sdpa" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got[0], want, **tol)
    for name, mine, ref in zip("qkv", got[1:], (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, ref, **tol, msg=name)


def test_groups_must_cover_the_tokens() -> None:
    from mindspeed.megatron.shared_prefix import attend_shared_prefix, shared_prefix_params
    from mindspeed.ops import resolve_kernel

    x = torch.zeros(7, 2, 4)
    with pytest.raises(ValueError, match="cover 6 tokens but the microbatch has 7"):
        attend_shared_prefix(resolve_kernel("attention", "sdpa"), x, x, x, shared_prefix_params([(2, (3, 1))]))
