"""Ring attention (``megatron_cp_algo``): key/value blocks travel around the ring.

Each of the ``R`` ranks holds a zig-zag shard of queries, keys and values. In ``R`` steps the
key/value blocks move one rank along the ring; at step ``i`` rank ``r`` holds rank
``(r - i) % R``'s block, attends its queries to it (the calls that
:func:`~mindspeed.parallel.context_parallel.blocks.plan_blocks` chose, through the registry's
``attention`` op with ``return_lse=True``) and folds the partial result into its running
``(out, lse)`` with the registry's ``ring_attention_update`` op. The next block's transfer
is posted (``batch_isend_irecv``) before the current block is computed, so the two overlap.

Autograd is a custom :class:`torch.autograd.Function`, not a chain of differentiable sends:
the forward saves only the local ``q, k, v``, the output and the fp32 ``lse`` (memory
``O(s / R)``), and the backward runs its own ring. With the merged output ``O``, global
``L`` and the block's ``(o_b, l_b)``, the merge is ``O = sum_b w_b o_b`` with
``w_b = exp(l_b - L)``, so a cotangent ``G`` of ``O`` reaches the block as
``d o_b = w_b G`` and ``d l_b = w_b <G, o_b - O>`` (exact: ``dL / dl_b = w_b``). The
backward recomputes each block with autograd on, pulls those two cotangents through it (the
``attention`` op's ``lse`` is differentiable on every backend) and accumulates ``dq`` locally;
``dk, dv`` accumulate in an fp32 buffer that travels around the ring with its key/value
block and arrives home after ``R`` hops. The key/value transfer of the next step and the
gradient buffer of the previous one both overlap the current block's compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.blocks import Block, plan_blocks
from mindspeed.parallel.context_parallel.comm import RingExchange
from mindspeed.parallel.context_parallel.layout import packed_shard_ranges, ranges_length, zigzag_ranges

_KV_TAG, _DKV_TAG = 11, 12


@dataclass(frozen=True)
class RingPlan:
    """What one ring rank computes at every step.

    Attributes:
        rank: the ring rank.
        lengths: local sequence length of every ring rank.
        steps: ``steps[i]``: the blocks of step ``i``, whose keys come from rank ``(rank - i) % R``.
    """

    rank: int
    lengths: tuple[int, ...]
    steps: tuple[tuple[Block, ...], ...]

    @property
    def size(self) -> int:
        """Number of ring ranks."""
        return len(self.lengths)


@functools.lru_cache(maxsize=256)
def plan_ring(
    seq_len: int, rank: int, size: int, causal: bool, bounds: tuple[int, ...] | None, per_sequence: bool = False
) -> RingPlan:
    """The :class:`RingPlan` of ring rank ``rank`` of ``size`` for a zig-zag sharded sequence.

    Args:
        seq_len: length of the whole sequence.
        rank: ring rank.
        size: ring degree ``R``.
        causal: causal mask.
        bounds: global packed-sequence boundaries, or ``None``.
        per_sequence: the shards are zig-zag per packed sequence (megatron's THD layout,
            :func:`~mindspeed.parallel.context_parallel.layout.packed_shard_ranges`), not of the whole row.
    """
    if per_sequence and bounds is not None:
        shards = [packed_shard_ranges(bounds, s, size) for s in range(size)]
    else:
        shards = [zigzag_ranges(seq_len, s, size) for s in range(size)]
    steps = tuple(
        tuple(plan_blocks(shards[rank], shards[(rank - i) % size], seq_len=seq_len, causal=causal, bounds=bounds))
        for i in range(size)
    )
    return RingPlan(rank=rank, lengths=tuple(ranges_length(s) for s in shards), steps=steps)


def _attend_block(
    attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``(out, lse)``; ``q`` holds the block's rows, ``k``/``v`` its keys."""
    cu = None
    if block.cu_seqlens is not None:
        cu = torch.tensor(block.cu_seqlens, dtype=torch.int32, device=q.device)
    return attend(q, k, v, causal=block.causal, softmax_scale=scale, cu_seqlens=cu, return_lse=True)


def _block_inputs(block: Block, q: torch.Tensor, kv: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    keys = slice(block.k_start, block.k_stop)
    return q[:, block.q_start : block.q_stop], kv[:batch, keys], kv[batch:, keys]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, attend, update, scale, overlap):  # type: ignore[override]
        batch, rank, size = q.shape[0], plan.rank, plan.size
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=0).contiguous()  # one message per step instead of two
        exchange = RingExchange(group) if size > 1 else None
        for step in range(size):
            recv, pending = None, []
            if step + 1 < size:
                recv = kv.new_empty((2 * batch, plan.lengths[(rank - step - 1) % size], *kv.shape[2:]))
                pending = exchange.start(kv, recv, tag=_KV_TAG)
                if not overlap:
                    exchange.wait(pending)
                    pending = []  # wait on a request once only: a second wait can block on gloo
            for block in plan.steps[step]:
                part_out, part_lse = _attend_block(attend, *_block_inputs(block, q, kv, batch), block, scale)
                rows = slice(block.q_start, block.q_stop)
                if block.q_start == 0 and block.q_stop == q.shape[1]:
                    out, lse = update(out, lse, part_out, part_lse)
                else:
                    out[:, rows], lse[:, :, rows] = update(out[:, rows], lse[:, :, rows], part_out, part_lse)
            if recv is not None:
                exchange.wait(pending)
                kv = recv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.attend, ctx.scale, ctx.overlap = group, plan, attend, scale, overlap
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan, attend, scale = ctx.plan, ctx.attend, ctx.scale
        batch, rank, size = q.shape[0], plan.rank, plan.size
        grad_out = grad_out.float()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=0).contiguous()
        exchange = RingExchange(ctx.group) if size > 1 else None
        grad_kv_pending = grad_kv_recv = None
        for step in range(size):
            source = (rank - step) % size
            kv_recv, kv_pending = None, []
            if step + 1 < size:
                kv_recv = kv.new_empty((2 * batch, plan.lengths[(source - 1) % size], *kv.shape[2:]))
                kv_pending = exchange.start(kv, kv_recv, tag=_KV_TAG)
                if not ctx.overlap:
                    exchange.wait(kv_pending)
                    kv_pending = []
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for block in plan.steps[step]:
                inputs = _block_inputs(block, q, kv, batch)
                gq, gk, gv = _block_grads(attend, inputs, block, scale, out, lse, grad_out)
                keys = slice(block.k_start, block.k_stop)
                grad_q[:, block.q_start : block.q_stop] += gq
                grad_kv[:batch, keys] += gk
                grad_kv[batch:, keys] += gv
            if grad_kv_pending is not None:
                # The gradient buffer of this block, from the ranks that held it before.
                exchange.wait(grad_kv_pending)
                grad_kv += grad_kv_recv
            if size > 1:
                # Pass it on; after the last step it reaches the block's owner, which receives its own.
                grad_kv_recv = grad_kv.new_empty((2 * batch, plan.lengths[(source - 1) % size], *kv.shape[2:]))
                grad_kv_pending = exchange.start(grad_kv, grad_kv_recv, tag=_DKV_TAG)
            if kv_recv is not None:
                exchange.wait(kv_pending)
                kv = kv_recv
        if grad_kv_pending is not None:
            exchange.wait(grad_kv_pending)
            grad_kv = grad_kv_recv
        grad_k, grad_v = grad_kv[:batch], grad_kv[batch:]
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, None


def _block_grads(
    attend: Callable,
    inputs: tuple[torch.Tensor, ...],
    block: Block,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Gradients of one block's ``(q rows, k, v)``: recompute it, pull the merge's cotangents through."""
    rows = slice(block.q_start, block.q_stop)
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        part_out, part_lse = _attend_block(attend, *leaves, block, scale)
    total_lse, block_lse = lse[:, :, rows], part_lse.detach()
    # w = exp(l_b - L); rows that saw no key in this block (or none at all) have weight 0.
    seen = torch.isfinite(total_lse) & torch.isfinite(block_lse)
    weight = torch.where(seen, torch.exp(block_lse - torch.where(seen, total_lse, 0.0)), 0.0)
    grad = grad_out[:, rows]
    grad_part_out = grad * weight.transpose(1, 2).unsqueeze(-1)
    grad_part_lse = weight * (grad * (part_out.detach().float() - out[:, rows].float())).sum(-1).transpose(1, 2)
    return torch.autograd.grad((part_out, part_lse), leaves, (grad_part_out.to(part_out.dtype), grad_part_lse))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    seq_len: int,
    causal: bool,
    softmax_scale: float,
    bounds: tuple[int, ...] | None,
    attend: Callable,
    update: Callable,
    overlap: bool = True,
    per_sequence: bool = False,
) -> torch.Tensor:
    """Ring attention over a zig-zag sharded sequence.

    Args:
        q: ``[b, s_local, heads_q, d]``, this ring rank's zig-zag shard.
        k: ``[b, s_local, heads_kv, d]``.
        v: same shape as ``k``.
        group: the ring group (``None``: a ring of one).
        seq_len: length of the whole sequence.
        causal: causal mask.
        softmax_scale: score scale.
        bounds: global packed-sequence boundaries, or ``None``.
        attend: the ``attention`` kernel; must support ``return_lse`` (and ``cu_seqlens`` when packed).
        update: the ``ring_attention_update`` kernel.
        overlap: post each transfer before the compute it overlaps (``False``: wait first).
        per_sequence: packed sequences are each split zig-zag (megatron's THD layout), not the row.

    Returns:
        ``[b, s_local, heads_q, d]``: the local rows of attention over the whole sequence.
    """
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    plan = plan_ring(seq_len, rank, size, causal, bounds, per_sequence)
    if q.shape[1] != plan.lengths[rank]:
        raise ValueError(
            f"ring rank {rank} of {size} holds {q.shape[1]} positions, but the zig-zag layout of a {seq_len}-token "
            f"sequence gives it {plan.lengths[rank]}; split inputs with split_for_context_parallel and pass seq_len"
        )
    if size == 1:
        if not plan.steps[0]:
            return torch.zeros_like(q)
        (block,) = plan.steps[0]
        cu = None if block.cu_seqlens is None else torch.tensor(block.cu_seqlens, dtype=torch.int32, device=q.device)
        return attend(q, k, v, causal=block.causal, softmax_scale=softmax_scale, cu_seqlens=cu)
    return _RingAttention.apply(q, k, v, group, plan, attend, update, softmax_scale, overlap)
