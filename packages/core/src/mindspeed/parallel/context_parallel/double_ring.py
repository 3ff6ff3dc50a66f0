"""Double ring attention (``megatron_cp_algo`` with ``cp_window_size = w > 1``; LoongTrain's double ring).

The ``C`` CP ranks form ``n = C / w`` windows of ``w`` consecutive ranks (usually one node
each). CP rank ``r`` is inner rank ``i = r % w`` of window ``m = r // w``. The layout, the
per-block plan (:func:`~mindspeed.parallel.context_parallel.ring.plan_ring`) and the block
step (:func:`~mindspeed.parallel.context_parallel.ring.fold_blocks` forward,
:func:`~mindspeed.parallel.context_parallel.ring.backward_blocks` backward, ALiBi included) are
the ring's; only the order in which the key/value blocks visit a
rank changes:

- **outer step** ``j = 0 .. n-1``: rank ``(m, i)`` holds the block of rank ``(m - j, i)``
  (same inner rank, ``j`` windows back), received over the *outer ring* (the ranks with the
  same inner rank, stride ``w``). The transfer for step ``j + 1`` is posted at the start of
  step ``j`` and waited at its end, so one inter-window hop overlaps ``w`` blocks of compute.
- **inner step** ``t = 0 .. w-1`` of each outer step: the block travels the *inner ring* (the
  window): rank ``(m, i)`` holds the block of rank ``(m - j, i - t)``. Each inner hop overlaps
  one block of compute, as in the plain ring.

Every rank meets every block exactly once (``n * w = C`` steps), so the result is the ring's.

Backward: the blocks follow the same schedule. ``dk, dv`` of a block accumulate in an fp32
buffer that travels the inner ring with it; one more inner hop brings the window's total to
the rank that received the block from the outer ring. There it is added to the running total
received from the previous window (which visited the block one outer step earlier) and sent
on over the outer ring, overlapping the next outer step. After ``n`` outer hops the total
arrives at the block's owner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.comm import RingExchange
from mindspeed.parallel.context_parallel.ring import (
    BlockKernels,
    RingPlan,
    backward_blocks,
    fold_blocks,
    plan_ring,
    start_exchange,
)

_INNER_KV_TAG, _INNER_DKV_TAG, _OUTER_KV_TAG, _OUTER_DKV_TAG = 21, 22, 23, 24


def _blocks(plan: RingPlan, source: int) -> tuple:
    """The blocks of this rank's queries against ``source``'s keys (the plan is indexed by ring distance)."""
    return plan.steps[(plan.rank - source) % plan.size]


class _DoubleRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, inner_group, outer_group, plan, kernels, overlap):  # type: ignore[override]
        batch = q.shape[0]
        width, windows = dist.get_world_size(inner_group), dist.get_world_size(outer_group)
        inner, window = divmod(plan.rank, width)[::-1]
        inner_ex, outer_ex = RingExchange(inner_group), RingExchange(outer_group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        outer_kv = torch.cat([k, v], dim=0).contiguous()
        for j in range(windows):
            home = (window - j) % windows  # the window whose blocks this outer step visits
            outer_recv, outer_pending = None, []
            if j + 1 < windows:
                length = plan.lengths[((window - j - 1) % windows) * width + inner]
                outer_recv = outer_kv.new_empty((2 * batch, length, *outer_kv.shape[2:]))
                outer_pending = start_exchange(outer_ex, outer_kv, outer_recv, _OUTER_KV_TAG, overlap)
            kv = outer_kv
            for t in range(width):
                source = home * width + (inner - t) % width
                recv, pending = None, []
                if t + 1 < width:
                    length = plan.lengths[home * width + (inner - t - 1) % width]
                    recv = kv.new_empty((2 * batch, length, *kv.shape[2:]))
                    pending = start_exchange(inner_ex, kv, recv, _INNER_KV_TAG, overlap)
                out, lse = fold_blocks(kernels, _blocks(plan, source), q, kv, out, lse)
                if recv is not None:
                    inner_ex.wait(pending)
                    kv = recv
            if outer_recv is not None:
                outer_ex.wait(outer_pending)
                outer_kv = outer_recv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.plan, ctx.kernels, ctx.overlap = (inner_group, outer_group), plan, kernels, overlap
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan, kernels, overlap = ctx.plan, ctx.kernels, ctx.overlap
        inner_group, outer_group = ctx.groups
        batch = q.shape[0]
        width, windows = dist.get_world_size(inner_group), dist.get_world_size(outer_group)
        inner, window = divmod(plan.rank, width)[::-1]
        inner_ex, outer_ex = RingExchange(inner_group), RingExchange(outer_group)
        grad_out = grad_out.float()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        outer_kv = torch.cat([k, v], dim=0).contiguous()
        total_recv, total_pending = None, None  # running dk, dv of the next outer block, from the previous window
        for j in range(windows):
            home = (window - j) % windows
            outer_recv, outer_pending = None, []
            if j + 1 < windows:
                length = plan.lengths[((window - j - 1) % windows) * width + inner]
                outer_recv = outer_kv.new_empty((2 * batch, length, *outer_kv.shape[2:]))
                outer_pending = start_exchange(outer_ex, outer_kv, outer_recv, _OUTER_KV_TAG, overlap)
            kv = outer_kv
            grad_recv, grad_pending = None, None
            for t in range(width):
                source = home * width + (inner - t) % width
                recv, pending = None, []
                if t + 1 < width:
                    length = plan.lengths[home * width + (inner - t - 1) % width]
                    recv = kv.new_empty((2 * batch, length, *kv.shape[2:]))
                    pending = start_exchange(inner_ex, kv, recv, _INNER_KV_TAG, overlap)
                grad_kv = backward_blocks(kernels, _blocks(plan, source), q, kv, out, lse, grad_out, grad_q)
                if grad_pending is not None:
                    inner_ex.wait(grad_pending)  # this block's gradient from the window ranks that held it before
                    grad_kv += grad_recv
                # Pass it on; after the last inner step it reaches the rank that got the block from outside.
                length = plan.lengths[home * width + (inner - t - 1) % width]
                grad_recv = grad_kv.new_empty((2 * batch, length, *kv.shape[2:]))
                grad_pending = inner_ex.start(grad_kv, grad_recv, tag=_INNER_DKV_TAG)
                if recv is not None:
                    inner_ex.wait(pending)
                    kv = recv
            inner_ex.wait(grad_pending)
            window_total = grad_recv  # this window's dk, dv of the outer block of step j
            if total_pending is not None:
                outer_ex.wait(total_pending)  # the windows before this one
                window_total = window_total + total_recv
            # On to the next window, which visits this block at step j + 1; after the last
            # step the next window is the owner's, and this rank receives its own block's total.
            length = plan.lengths[((window - j - 1) % windows) * width + inner]
            total_recv = window_total.new_empty((2 * batch, length, *kv.shape[2:]))
            total_pending = outer_ex.start(window_total, total_recv, tag=_OUTER_DKV_TAG)
            if outer_recv is not None:
                outer_ex.wait(outer_pending)
                outer_kv = outer_recv
        outer_ex.wait(total_pending)
        grad_k, grad_v = total_recv[:batch], total_recv[batch:]
        return (grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), *([None] * 5))


def double_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inner_group: dist.ProcessGroup,
    outer_group: dist.ProcessGroup,
    seq_len: int,
    causal: bool,
    softmax_scale: float,
    bounds: tuple[int, ...] | None,
    attend: Callable,
    update: Callable,
    overlap: bool = True,
    per_sequence: bool = False,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention whose blocks travel an inner ring (the window) and then an outer one.

    Args:
        q: ``[b, s_local, heads_q, d]``, this CP rank's zig-zag shard (the ring's layout).
        k: ``[b, s_local, heads_kv, d]``.
        v: same shape as ``k``.
        inner_group: this rank's window: ``w`` consecutive CP ranks (``build_context_parallel_groups``).
        outer_group: the CP ranks with this rank's inner rank (stride ``w``).
        seq_len: length of the whole sequence.
        causal: causal mask by global position.
        softmax_scale: score scale.
        bounds: global packed-sequence boundaries, or ``None``.
        attend: the ``attention`` kernel with ``return_lse`` (and ``cu_seqlens`` when packed).
        update: the ``ring_attention_update`` kernel.
        overlap: post each transfer before the compute it overlaps (``False``: wait first).
        per_sequence: packed sequences are each split zig-zag (megatron's THD layout).
        alibi_slopes: ``[heads_q]`` ALiBi slopes, each block biased by its global positions (as the ring).

    Returns:
        ``[b, s_local, heads_q, d]``: this rank's rows of attention over the whole sequence.
    """
    width, windows = dist.get_world_size(inner_group), dist.get_world_size(outer_group)
    rank = dist.get_rank(outer_group) * width + dist.get_rank(inner_group)
    plan = plan_ring(seq_len, rank, width * windows, causal, bounds, per_sequence, alibi_slopes is not None)
    if q.shape[1] != plan.lengths[rank]:
        raise ValueError(
            f"CP rank {rank} of {width * windows} holds {q.shape[1]} positions, but the zig-zag layout of a "
            f"{seq_len}-token sequence gives it {plan.lengths[rank]}; split inputs with split_for_context_parallel"
        )
    kernels = BlockKernels(attend=attend, update=update, scale=softmax_scale, alibi_slopes=alibi_slopes)
    return _DoubleRingAttention.apply(q, k, v, inner_group, outer_group, plan, kernels, overlap)
