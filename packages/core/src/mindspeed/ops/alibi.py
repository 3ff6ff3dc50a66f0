"""ALiBi (attention with linear biases, Press et al. 2022): per-head slopes and the score bias.

The score of query ``i`` and key ``j`` of head ``h`` gets ``-slope[h] * |pos_q(i) - pos_k(j)|``
added after the softmax scale, with the op's bottom-right alignment ``pos_q(i) = i + seq_k - seq_q``
(flash-attn's ``alibi_slopes`` convention). Under a causal mask this equals BLOOM's
``slope * j`` bias up to a per-row constant, which the softmax ignores; packed sequences see
the distance inside their own segment, so each segment gets the bias it would get alone.

The slopes are the paper's: for ``n`` heads a power of two, ``2 ** (-8 h / n)`` for
``h = 1 .. n``; otherwise those of the closest power of two below ``n`` followed by every other
slope of twice that power (the interleave of the reference code, transformers'
``build_alibi_tensor`` and BLOOM). Tensor parallelism gives each rank the slopes of its heads
(:func:`shard_alibi_slopes`).
"""

from __future__ import annotations

import math

import torch


def get_alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slopes of a model with ``num_heads`` attention heads, fp32 ``[num_heads]``.

    Raises:
        ValueError: ``num_heads`` is not a positive integer.
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer for ALiBi slopes; got {num_heads!r}")
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * h / power) for h in range(1, power + 1)]
    # The heads beyond the power of two take the odd slopes of twice that power.
    slopes += [2.0 ** (-4.0 * h / power) for h in range(1, 2 * (num_heads - power), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def shard_alibi_slopes(num_heads: int, rank: int, size: int) -> torch.Tensor:
    """The slopes of tensor-parallel rank ``rank`` of ``size``: its ``num_heads // size`` consecutive heads.

    Raises:
        ValueError: the heads do not divide evenly, or ``rank`` is outside ``[0, size)``.
    """
    if size < 1 or num_heads % size or not 0 <= rank < size:
        raise ValueError(
            f"ALiBi slopes of {num_heads} heads cannot be sharded to rank {rank} of {size}; "
            "the tensor-parallel size must divide the number of attention heads"
        )
    local = num_heads // size
    return get_alibi_slopes(num_heads)[rank * local : (rank + 1) * local]


def alibi_bias(
    slopes: torch.Tensor, seq_q: int, seq_k: int, device: torch.device | str | None = None, offset: int = 0
) -> torch.Tensor:
    """The fp32 bias ``[heads, seq_q, seq_k]``: ``-slope * |i + seq_k - seq_q + offset - j|``.

    The slopes are constants of the model (no gradient flows to them, as in flash-attn).

    Args:
        slopes: ``[heads]`` slopes (any float dtype; used in fp32).
        seq_q: number of queries.
        seq_k: number of keys.
        device: where to build it (default: the slopes').
        offset: shifts the queries' positions against the keys' (the ``attention`` op's
            ``alibi_offset``: a block of a longer sequence whose rows and keys are not aligned
            bottom-right, as in ring attention).
    """
    device = slopes.device if device is None else device
    q_pos = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q + offset)
    k_pos = torch.arange(seq_k, device=device)[None, :]
    distance = (q_pos - k_pos).abs().float()
    return -slopes.detach().to(device=device, dtype=torch.float32)[:, None, None] * distance


def check_alibi_slopes(slopes: torch.Tensor, num_heads: int) -> None:
    """Raise ``ValueError`` unless ``slopes`` is a 1-D float tensor with one slope per query head."""
    if slopes.dim() != 1 or slopes.shape[0] != num_heads or not slopes.is_floating_point():
        raise ValueError(
            f"alibi_slopes must be a 1-D float tensor of one slope per query head ({num_heads}); "
            f"got {slopes.dtype}{list(slopes.shape)} (use mindspeed.ops.alibi.get_alibi_slopes)"
        )
