"""KV all-gather context parallelism (``kvallgather_cp_algo``; megatron's ``cp_comm_type="all_gather"``).

Every rank keeps its load-balanced zig-zag query shard (the ring's layout: chunks ``r`` and
``2C - 1 - r`` of ``2C``, or per packed sequence in megatron's THD layout), all-gathers the
keys and values of the whole sequence over the CP group (one collective, k and v in one
message, ``heads_kv`` wide, so GQA gathers only its kv heads), and attends its queries to
them through the registry's ``attention`` op. Autograd is the op's own plus the gather's: the
backward of the all-gather is a reduce-scatter of ``dk, dv`` back to their owners.

Positions. Each local query chunk is a contiguous global range ``[a, b)``. The op aligns
queries bottom-right (query ``i`` of ``n`` sits at key position ``i + seq_k - n``), so a call
with the chunk's queries and the keys ``[k0, b)`` puts query ``i`` at global position
``a + i``, whatever ``k0``: the causal mask, a sliding window and ALiBi's distances all come out
by true global position, with no offset argument. Packed sequences (``cu_seqlens``, EOD reset)
cut a chunk into pieces, one per packed sequence it touches: a piece that starts a sequence
only sees keys inside itself, so consecutive such pieces are one varlen call over their own
rows; a piece that continues a sequence begun before the chunk is one call against that
sequence's earlier keys. So a rank makes at most two calls per chunk (causal), and a window
``(W, 0)`` trims the gathered keys a call reads to the last ``W`` before the chunk.

Memory: the gathered ``k, v`` (``2 * b * S * heads_kv * d`` per layer, the whole sequence)
are held from the forward to the backward (the op's autograd saves them), against ring's
``O(S / C)``; the query side, scores and output stay ``1/C``. That is what buys the single
collective and the freedom of masks: the ring must plan every (query block, key block) pair
of a mask, this algorithm only slices one key range per query chunk.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.layout import Ranges, packed_shard_ranges, ranges_length, zigzag_ranges


@dataclass(frozen=True)
class KvCall:
    """One attention call: local query rows against a range of the gathered keys.

    Attributes:
        q_start: first local query row.
        q_stop: one past the last local query row.
        k_start: first global key position.
        k_stop: one past the last global key position.
        cu_seqlens: local packed-sequence boundaries of the call's rows (its keys are its own
            rows then), ``None`` when it is one sequence.
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    cu_seqlens: tuple[int, ...] | None = None


def _pieces(lo: int, hi: int, bounds: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """``[lo, hi)`` cut at the packed-sequence boundaries: ``(start, stop, seq_start, seq_stop)`` each."""
    found, start = [], lo
    while start < hi:
        index = bisect.bisect_right(bounds, start) - 1
        seq_start, seq_stop = bounds[index], bounds[index + 1]
        stop = min(hi, seq_stop)
        found.append((start, stop, seq_start, seq_stop))
        start = stop
    return found


def _chunk_calls(lo: int, hi: int, offset: int, bounds: tuple[int, ...], causal: bool, left: int) -> list[KvCall]:
    """The calls of one local chunk, global ``[lo, hi)`` at local ``offset``."""
    calls: list[KvCall] = []
    own: list[tuple[int, int]] = []  # pieces whose visible keys are their own rows: one varlen call

    def flush() -> None:
        if own:
            first, last = own[0][0], own[-1][1]
            cu = tuple(p[0] - first for p in own) + (last - first,)
            calls.append(KvCall(first - lo + offset, last - lo + offset, first, last, cu if len(cu) > 2 else None))
            own.clear()

    for start, stop, seq_start, seq_stop in _pieces(lo, hi, bounds):
        k_stop = stop if causal else seq_stop
        if start == seq_start and k_stop == stop:
            own.append((start, stop))
            continue
        flush()
        k_start = max(seq_start, start - left) if causal and left >= 0 else seq_start
        calls.append(KvCall(start - lo + offset, stop - lo + offset, k_start, k_stop))
    flush()
    return calls


@functools.lru_cache(maxsize=256)
def plan_kv_allgather(
    seq_len: int,
    rank: int,
    size: int,
    causal: bool,
    bounds: tuple[int, ...] | None,
    per_sequence: bool = False,
    left: int = -1,
) -> tuple[tuple[Ranges, ...], tuple[KvCall, ...]]:
    """Every rank's shard ranges and this rank's attention calls.

    Args:
        seq_len: length of the whole sequence.
        rank: CP rank.
        size: CP degree ``C``.
        causal: causal mask.
        bounds: global packed-sequence boundaries, or ``None``.
        per_sequence: shards are zig-zag per packed sequence (megatron's THD layout).
        left: the window's left bound under a causal mask (``-1``: unbounded); trims the keys.

    Returns:
        ``(shards, calls)``: the global ranges of every rank's shard, and the calls, in local
        row order, that cover this rank's rows exactly once.
    """
    if per_sequence and bounds is not None:
        shards = tuple(packed_shard_ranges(bounds, r, size) for r in range(size))
    else:
        shards = tuple(zigzag_ranges(seq_len, r, size) for r in range(size))
    segments = bounds if bounds is not None else (0, seq_len)
    calls, offset = [], 0
    for lo, hi in shards[rank]:
        if hi > lo:
            calls.extend(_chunk_calls(lo, hi, offset, segments, causal, left))
        offset += hi - lo
    return shards, tuple(calls)


class _GatherKV(torch.autograd.Function):
    """All-gather of zig-zag shards into the whole sequence; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, local, group, shards, rank):  # type: ignore[override]
        ctx.group, ctx.shards, ctx.rank = group, shards, rank
        longest = max(ranges_length(s) for s in shards)
        # Collectives need equal sizes: pad every shard to the longest one (uneven lengths).
        padded = local.new_zeros(local.shape[0], longest, *local.shape[2:])
        padded[:, : local.shape[1]] = local
        buffers = [torch.empty_like(padded) for _ in shards]
        dist.all_gather(buffers, padded, group=group)
        full = local.new_empty(local.shape[0], sum(ranges_length(s) for s in shards), *local.shape[2:])
        for buffer, ranges in zip(buffers, shards):
            offset = 0
            for lo, hi in ranges:
                full[:, lo:hi] = buffer[:, offset : offset + hi - lo]
                offset += hi - lo
        return full

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        shards, rank = ctx.shards, ctx.rank
        longest = max(ranges_length(s) for s in shards)
        pieces = []
        for ranges in shards:
            piece = grad.new_zeros(grad.shape[0], longest, *grad.shape[2:])
            offset = 0
            for lo, hi in ranges:
                piece[:, offset : offset + hi - lo] = grad[:, lo:hi]
                offset += hi - lo
            pieces.append(piece)
        out = torch.empty_like(pieces[0])
        dist.reduce_scatter(out, pieces, group=ctx.group)
        return out[:, : ranges_length(shards[rank])], None, None, None


def kv_allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    seq_len: int,
    causal: bool,
    softmax_scale: float,
    bounds: tuple[int, ...] | None,
    attend: Callable,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    per_sequence: bool = False,
) -> torch.Tensor:
    """Attention of this rank's zig-zag query shard against the all-gathered keys and values.

    Args:
        q: ``[b, s_local, heads_q, d]``, this CP rank's zig-zag shard.
        k: ``[b, s_local, heads_kv, d]``.
        v: same shape as ``k``.
        group: the CP group.
        seq_len: length of the whole sequence.
        causal: causal mask by global position.
        softmax_scale: score scale.
        bounds: global packed-sequence boundaries, or ``None``.
        attend: the ``attention`` kernel (``window``, ``alibi`` and ``varlen`` features as used).
        window_size: ``(left, right)`` sliding window by global position; needs ``causal``.
        alibi_slopes: ``[heads_q]`` ALiBi slopes; needs ``causal``.
        per_sequence: packed sequences are each split zig-zag (megatron's THD layout).

    Returns:
        ``[b, s_local, heads_q, d]``: this rank's rows of attention over the whole sequence.
    """
    left, right = (int(w) for w in window_size)
    if not causal and (left >= 0 or right >= 0 or alibi_slopes is not None):
        raise ValueError(
            "kvallgather_cp_algo applies a window or ALiBi only under a causal mask (keys up to the query); "
            "use causal attention or another context_parallel_algo"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shards, calls = plan_kv_allgather(seq_len, rank, size, causal, bounds, per_sequence, left)
    if q.shape[1] != ranges_length(shards[rank]):
        raise ValueError(
            f"CP rank {rank} of {size} holds {q.shape[1]} positions, but the zig-zag layout of a {seq_len}-token "
            f"sequence gives it {ranges_length(shards[rank])}; split inputs with split_for_context_parallel"
        )
    batch = k.shape[0]
    kv = torch.cat([k, v], dim=0)  # one collective for both
    full = _GatherKV.apply(kv, group, shards, rank) if size > 1 else kv
    extra = {"softmax_scale": softmax_scale, "window_size": (left, right)}
    if alibi_slopes is not None:
        extra["alibi_slopes"] = alibi_slopes
    outs = []
    for call in calls:
        keys = full[:, call.k_start : call.k_stop]
        cu = None if call.cu_seqlens is None else torch.tensor(call.cu_seqlens, dtype=torch.int32, device=q.device)
        rows = q[:, call.q_start : call.q_stop]
        outs.append(attend(rows, keys[:batch], keys[batch:], causal=causal, cu_seqlens=cu, **extra))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
