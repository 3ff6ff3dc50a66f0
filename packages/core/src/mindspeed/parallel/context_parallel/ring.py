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

The block step (:class:`BlockKernels`, :func:`attend_block`, :func:`block_inputs`,
:func:`fold_blocks`, :func:`block_grads`, :func:`backward_blocks`, :func:`start_exchange`) is
public: the double ring (:mod:`~mindspeed.parallel.context_parallel.double_ring`) runs the same
steps in another visiting order.

ALiBi: the plan is then made of blocks of consecutive positions (``plan_ring(..., contiguous=True)``),
and each block is called with ``alibi_offset`` (:meth:`~mindspeed.parallel.context_parallel.blocks.Block.alibi_offset`),
so its bias is that of its rows' and keys' global positions; the block's ``lse`` includes the
bias, so the merge and the backward are unchanged.
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
    seq_len: int,
    rank: int,
    size: int,
    causal: bool,
    bounds: tuple[int, ...] | None,
    per_sequence: bool = False,
    contiguous: bool = False,
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
        contiguous: blocks of consecutive positions with their global positions
            (``plan_blocks(..., contiguous=True)``), what ALiBi needs.
    """
    if per_sequence and bounds is not None:
        shards = [packed_shard_ranges(bounds, s, size) for s in range(size)]
    else:
        shards = [zigzag_ranges(seq_len, s, size) for s in range(size)]
    steps = tuple(
        tuple(
            plan_blocks(
                shards[rank],
                shards[(rank - i) % size],
                seq_len=seq_len,
                causal=causal,
                bounds=bounds,
                contiguous=contiguous,
            )
        )
        for i in range(size)
    )
    return RingPlan(rank=rank, lengths=tuple(ranges_length(s) for s in shards), steps=steps)


# -- the block step: shared by the ring and the double ring ----------------------------------


@dataclass(frozen=True)
class BlockKernels:
    """What every block of a ring step is computed and merged with.

    Attributes:
        attend: the ``attention`` kernel, with ``return_lse`` (and ``cu_seqlens`` when packed;
            ``alibi_slopes`` and ``alibi_offset`` with ALiBi).
        update: the ``ring_attention_update`` kernel.
        scale: the score scale.
        alibi_slopes: ``[heads_q]`` ALiBi slopes, or ``None``. The blocks must then carry their
            global positions (``plan_ring(..., contiguous=True)``).
    """

    attend: Callable
    update: Callable
    scale: float
    alibi_slopes: torch.Tensor | None = None


def attend_block(
    kernels: BlockKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's ``(out, lse)``; ``q`` holds the block's rows, ``k``/``v`` its keys.

    With ALiBi the bias is that of the rows' and keys' global positions (``Block.alibi_offset``).
    """
    cu = None
    if block.cu_seqlens is not None:
        cu = torch.tensor(block.cu_seqlens, dtype=torch.int32, device=q.device)
    extra = {}
    if kernels.alibi_slopes is not None:
        extra = {"alibi_slopes": kernels.alibi_slopes, "alibi_offset": block.alibi_offset()}
    return kernels.attend(
        q, k, v, causal=block.causal, softmax_scale=kernels.scale, cu_seqlens=cu, return_lse=True, **extra
    )


def block_inputs(block: Block, q: torch.Tensor, kv: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """``(rows of q, keys, values)`` of ``block``; ``kv`` is the received block, ``k`` and ``v`` stacked on the batch."""
    keys = slice(block.k_start, block.k_stop)
    return q[:, block.q_start : block.q_stop], kv[:batch, keys], kv[batch:, keys]


def fold_blocks(
    kernels: BlockKernels,
    blocks: tuple[Block, ...],
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of one ring step: attend ``q`` to the received ``kv`` by ``blocks`` and merge into ``(out, lse)``.

    Args:
        kernels: the kernels and scale.
        blocks: the step's blocks (:attr:`RingPlan.steps`).
        q: the local queries.
        kv: the received keys and values, stacked on the batch (``[2 b, s_block, heads_kv, d]``).
        out: the fp32 running output, ``q``'s shape.
        lse: the fp32 running log-sum-exp, ``[b, heads_q, s_local]``.

    Returns:
        The updated ``(out, lse)`` (updated in place where a block covers only some rows).
    """
    batch = q.shape[0]
    for block in blocks:
        part_out, part_lse = attend_block(kernels, *block_inputs(block, q, kv, batch), block)
        if block.q_start == 0 and block.q_stop == q.shape[1]:
            out, lse = kernels.update(out, lse, part_out, part_lse)
        else:
            rows = slice(block.q_start, block.q_stop)
            out[:, rows], lse[:, :, rows] = kernels.update(out[:, rows], lse[:, :, rows], part_out, part_lse)
    return out, lse


def block_grads(
    kernels: BlockKernels,
    inputs: tuple[torch.Tensor, ...],
    block: Block,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Gradients of one block's ``(q rows, k, v)``: recompute it, pull the merge's cotangents through."""
    rows = slice(block.q_start, block.q_stop)
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        part_out, part_lse = attend_block(kernels, *leaves, block)
    total_lse, block_lse = lse[:, :, rows], part_lse.detach()
    # w = exp(l_b - L); rows that saw no key in this block (or none at all) have weight 0.
    seen = torch.isfinite(total_lse) & torch.isfinite(block_lse)
    weight = torch.where(seen, torch.exp(block_lse - torch.where(seen, total_lse, 0.0)), 0.0)
    grad = grad_out[:, rows]
    grad_part_out = grad * weight.transpose(1, 2).unsqueeze(-1)
    grad_part_lse = weight * (grad * (part_out.detach().float() - out[:, rows].float())).sum(-1).transpose(1, 2)
    return torch.autograd.grad((part_out, part_lse), leaves, (grad_part_out.to(part_out.dtype), grad_part_lse))


def backward_blocks(
    kernels: BlockKernels,
    blocks: tuple[Block, ...],
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_q: torch.Tensor,
) -> torch.Tensor:
    """Backward of one ring step: add the blocks' ``dq`` into ``grad_q``; return the received block's fp32 ``dk, dv``.

    Args:
        kernels: the kernels and scale of the forward.
        blocks: the step's blocks.
        q: the local queries.
        kv: the received keys and values, stacked on the batch.
        out: the merged output of the forward.
        lse: the merged fp32 log-sum-exp of the forward.
        grad_out: the fp32 cotangent of ``out``.
        grad_q: the fp32 running ``dq`` (added to in place).

    Returns:
        ``[2 b, s_block, heads_kv, d]`` fp32: this rank's part of the block's ``dk`` (first ``b``) and ``dv``.
    """
    batch = q.shape[0]
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for block in blocks:
        gq, gk, gv = block_grads(kernels, block_inputs(block, q, kv, batch), block, out, lse, grad_out)
        keys = slice(block.k_start, block.k_stop)
        grad_q[:, block.q_start : block.q_stop] += gq
        grad_kv[:batch, keys] += gk
        grad_kv[batch:, keys] += gv
    return grad_kv


def start_exchange(exchange: RingExchange, send: torch.Tensor, recv: torch.Tensor, tag: int, overlap: bool) -> list:
    """Post ``send -> recv`` on the ring; without ``overlap`` wait for it at once (and return no request)."""
    pending = exchange.start(send, recv, tag=tag)
    if not overlap:
        exchange.wait(pending)
        return []  # wait on a request once only: a second wait can block on gloo
    return pending


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, kernels, overlap):  # type: ignore[override]
        batch, rank, size = q.shape[0], plan.rank, plan.size
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=0).contiguous()  # one message per step instead of two
        exchange = RingExchange(group) if size > 1 else None
        for step in range(size):
            recv, pending = None, []
            if step + 1 < size:
                recv = kv.new_empty((2 * batch, plan.lengths[(rank - step - 1) % size], *kv.shape[2:]))
                pending = start_exchange(exchange, kv, recv, _KV_TAG, overlap)
            out, lse = fold_blocks(kernels, plan.steps[step], q, kv, out, lse)
            if recv is not None:
                exchange.wait(pending)
                kv = recv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan, ctx.kernels, ctx.overlap = group, plan, kernels, overlap
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
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
                kv_pending = start_exchange(exchange, kv, kv_recv, _KV_TAG, ctx.overlap)
            grad_kv = backward_blocks(ctx.kernels, plan.steps[step], q, kv, out, lse, grad_out, grad_q)
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
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


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
    alibi_slopes: torch.Tensor | None = None,
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
        alibi_slopes: ``[heads_q]`` ALiBi slopes (``attend`` must take them and ``alibi_offset``);
            every block gets the bias of its rows' and keys' global positions.

    Returns:
        ``[b, s_local, heads_q, d]``: the local rows of attention over the whole sequence.
    """
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    plan = plan_ring(seq_len, rank, size, causal, bounds, per_sequence, alibi_slopes is not None)
    if q.shape[1] != plan.lengths[rank]:
        raise ValueError(
            f"ring rank {rank} of {size} holds {q.shape[1]} positions, but the zig-zag layout of a {seq_len}-token "
            f"sequence gives it {plan.lengths[rank]}; split inputs with split_for_context_parallel and pass seq_len"
        )
    if size == 1:
        # One call over the whole sequence (its positions are the local ones, ALiBi needs no offset).
        steps = plan_ring(seq_len, rank, size, causal, bounds, per_sequence).steps
        if not steps[0]:
            return torch.zeros_like(q)
        (block,) = steps[0]
        cu = None if block.cu_seqlens is None else torch.tensor(block.cu_seqlens, dtype=torch.int32, device=q.device)
        extra = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
        return attend(q, k, v, causal=block.causal, softmax_scale=softmax_scale, cu_seqlens=cu, **extra)
    kernels = BlockKernels(attend=attend, update=update, scale=softmax_scale, alibi_slopes=alibi_slopes)
    return _RingAttention.apply(q, k, v, group, plan, kernels, overlap)
