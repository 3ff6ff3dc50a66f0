"""Merging partial attention results: ``ring_attention_update``.

Ring (context-parallel) attention computes attention of the local queries against one key
block at a time; each block gives an output and the log-sum-exp of its scores
(``attention(..., return_lse=True)``). Two such partial results over disjoint key sets merge
exactly with the online-softmax rule::

    lse = logaddexp(prev_lse, cur_lse)
    out = prev_out * exp(prev_lse - lse) + cur_out * exp(cur_lse - lse)

Folding every block in turn gives attention over all keys, outputs and gradients alike.
"""

from __future__ import annotations

import torch

from mindspeed.ops.registry import Case, OpSpec, register_op


def ring_attention_update_reference(
    prev_out: torch.Tensor, prev_lse: torch.Tensor, cur_out: torch.Tensor, cur_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key blocks, in fp32.

    Args:
        prev_out: ``[batch, seq, heads, dim]`` output over the keys seen so far.
        prev_lse: ``[batch, heads, seq]`` fp32 log-sum-exp of those keys' scores.
        cur_out: ``[batch, seq, heads, dim]`` output over the new key block.
        cur_lse: ``[batch, heads, seq]`` log-sum-exp of the new block's scores.

    Returns:
        ``(out, lse)``: the merged output in ``prev_out``'s dtype and the merged fp32 ``lse``.
        A row where both ``lse`` are ``-inf`` (no key seen yet) gives ``out = 0`` and
        ``lse = -inf``, with zero (not NaN) gradients.
    """
    if prev_out.shape != cur_out.shape or prev_lse.shape != cur_lse.shape:
        raise ValueError(
            f"partial results must have equal shapes; got out {list(prev_out.shape)} vs {list(cur_out.shape)}, "
            f"lse {list(prev_lse.shape)} vs {list(cur_lse.shape)}"
        )
    batch, seq, heads, _ = prev_out.shape
    if tuple(prev_lse.shape) != (batch, heads, seq):
        raise ValueError(f"lse must be [batch, heads, seq] = {[batch, heads, seq]}; got {list(prev_lse.shape)}")
    prev_lse, cur_lse = prev_lse.float(), cur_lse.float()
    # Shift by the row max for stability; a row where both are -inf shifts by 0 instead of
    # NaN. The shift is detached because the result does not depend on it.
    shift = torch.maximum(prev_lse, cur_lse).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    prev_weight = torch.exp(prev_lse - shift)
    cur_weight = torch.exp(cur_lse - shift)
    total = prev_weight + cur_weight
    has_key = total > 0
    total = torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(has_key, shift + torch.log(total), float("-inf"))
    # Weights are [b, n, s]; outputs are [b, s, n, d].
    prev_scale = (prev_weight / total).transpose(1, 2).unsqueeze(-1)
    cur_scale = (cur_weight / total).transpose(1, 2).unsqueeze(-1)
    out = prev_out.float() * prev_scale + cur_out.float() * cur_scale
    return out.to(prev_out.dtype), lse


def _update_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def partial(batch: int, seq: int, heads: int, dim: int, lse_spread: float = 2.0) -> tuple:
        out = torch.randn(batch, seq, heads, dim, generator=gen)
        lse = lse_spread * torch.randn(batch, heads, seq, generator=gen)
        return out, lse

    def place(*tensors: torch.Tensor) -> tuple:
        # Outputs in the case dtype, lse always fp32.
        return tuple(t.to(device, dtype if i % 2 == 0 else torch.float32) for i, t in enumerate(tensors))

    (p_out, p_lse), (c_out, c_lse) = partial(1, 7, 3, 5), partial(1, 7, 3, 5)
    # Rows without keys: only in prev, only in cur, and in both (outputs are 0 there).
    p_lse[0, 0, :2] = float("-inf")
    c_lse[0, 1, 2:4] = float("-inf")
    p_lse[0, 2, 5:], c_lse[0, 2, 5:] = float("-inf"), float("-inf")
    for lse, out in ((p_lse, p_out), (c_lse, c_out)):
        out.masked_fill_(torch.isinf(lse).transpose(1, 2).unsqueeze(-1), 0.0)
    return [
        Case("random", place(*partial(2, 5, 4, 16), *partial(2, 5, 4, 16))),
        Case("odd shape, rows without keys", place(p_out, p_lse, c_out, c_lse)),
        Case("far apart lse", place(*partial(1, 9, 2, 8, lse_spread=60.0), *partial(1, 9, 2, 8, lse_spread=60.0))),
    ]


def _update_bench(dtype: torch.dtype, device: torch.device) -> Case:
    batch, seq, heads, dim = 1, 4096, 16, 128
    outs = [torch.randn(batch, seq, heads, dim, device=device, dtype=dtype) for _ in range(2)]
    lses = [torch.randn(batch, heads, seq, device=device, dtype=torch.float32) for _ in range(2)]
    return Case(f"b{batch} s{seq} n{heads} d{dim}", (outs[0], lses[0], outs[1], lses[1]))


register_op(
    OpSpec(
        name="ring_attention_update",
        reference=ring_attention_update_reference,
        doc="merge two partial attention results (out, lse) over disjoint key blocks, online softmax",
        cases=_update_cases,
        bench_case=_update_bench,
    )
)
