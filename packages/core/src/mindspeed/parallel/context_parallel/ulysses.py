"""Ulysses (``ulysses_cp_algo``): trade the sequence shard for a head shard with two all-to-alls.

Each of the ``U`` ranks holds a contiguous sequence shard with every head. The first
all-to-all gives every rank the whole sequence for ``1/U`` of the heads (rank ``j`` gets heads
``[j * h / U, (j + 1) * h / U)``); attention then runs locally, unchanged (any kernel, no
``lse`` needed, packed sequences with their global boundaries), and the second all-to-all
returns the output to sequence shards. Both are differentiable (each one's backward is the
other).

Constraints: the query heads must divide by ``U``. Grouped-query attention with key/value
heads that do not divide by ``U`` (fewer kv heads than ranks, say) replicates each kv head
``e = U / gcd(kv_heads, U)`` times before the all-to-all: then every rank receives exactly the
kv heads its query heads use (MindSpeed's ``--use-ulysses-allgather-kv`` case: with one kv head
every rank receives all of it), and the backward of the replication sums the copies' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from mindspeed.parallel.context_parallel.comm import heads_to_seq, seq_to_heads
from mindspeed.parallel.context_parallel.layout import split_sizes


def check_ulysses_heads(heads_q: int, heads_kv: int, degree: int) -> None:
    """Raise ``ValueError`` when ``degree`` Ulysses ranks cannot split the heads.

    Args:
        heads_q: query heads (per tensor-parallel rank).
        heads_kv: key/value heads (per tensor-parallel rank).
        degree: the Ulysses degree ``U``.
    """
    if heads_q % degree != 0:
        raise ValueError(
            f"Ulysses needs the query heads ({heads_q}) to be divisible by the Ulysses degree ({degree}); "
            "lower context_parallel_size (or ulysses_degree_in_cp) or use megatron_cp_algo"
        )
    if heads_q % heads_kv != 0:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of kv heads ({heads_kv})")


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicate kv heads so that ``degree`` ranks can each take the kv heads their q heads use.

    Args:
        k: ``[b, s, heads_kv, d]``.
        v: same shape.
        degree: the Ulysses degree ``U``.

    Returns:
        ``k, v`` unchanged when ``heads_kv % U == 0``, else with each head repeated
        ``U / gcd(heads_kv, U)`` times (consecutively, so grouped-query pairing is kept).
    """
    heads_kv = k.shape[2]
    if heads_kv % degree == 0:
        return k, v
    repeat = degree // math.gcd(heads_kv, degree)
    return k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    seq_len: int,
    causal: bool,
    softmax_scale: float,
    cu_seqlens: torch.Tensor | None,
    attend: Callable,
) -> torch.Tensor:
    """Ulysses attention over contiguous sequence shards.

    Args:
        q: ``[b, s_local, heads_q, d]``, this rank's contiguous shard.
        k: ``[b, s_local, heads_kv, d]``.
        v: same shape as ``k``.
        group: the Ulysses group (its rank order is the shard order).
        seq_len: length of the whole sequence.
        causal: causal mask.
        softmax_scale: score scale.
        cu_seqlens: global packed-sequence boundaries, or ``None``.
        attend: the ``attention`` kernel.

    Returns:
        ``[b, s_local, heads_q, d]``.
    """
    degree = dist.get_world_size(group)
    check_ulysses_heads(q.shape[2], k.shape[2], degree)
    sizes = split_sizes(seq_len, degree)
    k, v = expand_kv_heads(k, v, degree)
    q, k, v = seq_to_heads([q, k, v], group, sizes)
    out = attend(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
    return heads_to_seq([out], group, sizes)[0]
