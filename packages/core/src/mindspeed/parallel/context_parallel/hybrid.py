"""Hybrid Ulysses x ring (``hybrid_cp_algo``, USP): Ulysses inside a ring.

The CP group of ``C = U * R`` ranks is cut into ``R`` Ulysses groups of ``U`` consecutive CP
ranks, and ``U`` ring groups of the ranks with the same Ulysses rank. The sequence is first
zig-zag sharded over the ring ranks, then each ring rank's shard is cut contiguously among
its Ulysses group (see :mod:`~mindspeed.parallel.context_parallel.layout`). An all-to-all in
the Ulysses group turns the ``U`` pieces into the whole ring shard with ``1/U`` of the heads;
ring attention over the ring group computes those heads over the whole sequence; the inverse
all-to-all returns the output to the pieces. Ulysses' all-to-all traffic stays inside the
(usually intra-node) Ulysses group, and the ring needs only ``R`` steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.comm import heads_to_seq, seq_to_heads
from mindspeed.parallel.context_parallel.layout import ranges_length, split_sizes, zigzag_ranges
from mindspeed.parallel.context_parallel.ring import ring_attention
from mindspeed.parallel.context_parallel.ulysses import check_ulysses_heads, expand_kv_heads


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    seq_len: int,
    causal: bool,
    softmax_scale: float,
    bounds: tuple[int, ...] | None,
    attend: Callable,
    update: Callable,
    overlap: bool = True,
) -> torch.Tensor:
    """Ulysses all-to-all, ring attention over the ring group, inverse all-to-all.

    Args:
        q: ``[b, s_local, heads_q, d]``, this rank's hybrid shard.
        k: ``[b, s_local, heads_kv, d]``.
        v: same shape as ``k``.
        ulysses_group: this rank's Ulysses group (``U`` consecutive CP ranks).
        ring_group: this rank's ring group (the CP ranks with the same Ulysses rank).
        seq_len: length of the whole sequence.
        causal: causal mask.
        softmax_scale: score scale.
        bounds: global packed-sequence boundaries, or ``None``.
        attend: the ``attention`` kernel with ``return_lse``.
        update: the ``ring_attention_update`` kernel.
        overlap: overlap the ring's transfers with compute.

    Returns:
        ``[b, s_local, heads_q, d]``.
    """
    degree = dist.get_world_size(ulysses_group)
    ring_size, ring_rank = dist.get_world_size(ring_group), dist.get_rank(ring_group)
    check_ulysses_heads(q.shape[2], k.shape[2], degree)
    sizes = split_sizes(ranges_length(zigzag_ranges(seq_len, ring_rank, ring_size)), degree)
    k, v = expand_kv_heads(k, v, degree)
    q, k, v = seq_to_heads([q, k, v], ulysses_group, sizes)
    out = ring_attention(
        q,
        k,
        v,
        group=ring_group,
        seq_len=seq_len,
        causal=causal,
        softmax_scale=softmax_scale,
        bounds=bounds,
        attend=attend,
        update=update,
        overlap=overlap,
    )
    return heads_to_seq([out], ulysses_group, sizes)[0]
