"""Which sequence positions each context-parallel rank holds, and splitting/gathering by it.

Every algorithm shards the sequence dimension; they differ in how:

- ``ulysses_cp_algo``: contiguous. CP rank ``r`` of ``C`` holds chunk ``r`` of ``C`` chunks.
- ``megatron_cp_algo`` (ring): zig-zag. The sequence is cut into ``2 * C`` chunks and rank
  ``r`` holds chunks ``r`` and ``2 * C - 1 - r``, in that order. Under a causal mask the
  early chunks see few keys and the late ones many; pairing them gives every rank the same
  work.
- ``kvallgather_cp_algo`` (KV all-gather): the ring's zig-zag, for the same balance.
- ``hybrid_cp_algo``: the ring's zig-zag over the ``R = C / U`` ring ranks, then each ring
  rank's two chunks (concatenated) are cut contiguously among its ``U`` Ulysses ranks. CP rank
  ``r`` is ring rank ``r // U`` and Ulysses rank ``r % U`` (Ulysses groups are consecutive CP
  ranks, as in MindSpeed).

Unaligned lengths use uneven chunks, not padding: a sequence of ``S`` tokens cut into ``P``
chunks gives the first ``S % P`` chunks one token more (``torch.tensor_split``'s rule). No
pad token ever enters the model, so neither the loss nor a non-causal mask needs to know
about padding; the price is that every rank must know ``S`` (not only its own length) to size
its messages, which is why the attention entry takes ``seq_len``.

A rank's shard is described by its :func:`shard_ranges`: the global ``[start, stop)`` ranges
it holds, in local order. Local order is always ascending in global position, which is what
lets the attention kernels apply causal masks by local index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

ULYSSES = "ulysses_cp_algo"
RING = "megatron_cp_algo"
HYBRID = "hybrid_cp_algo"
KVALLGATHER = "kvallgather_cp_algo"
ADAPTIVE = "adaptive_cp_algo"
#: MindSpeed's ``--context-parallel-algo`` names that this package implements.
ALGOS = (ULYSSES, RING, HYBRID, KVALLGATHER, ADAPTIVE)
#: Algorithms that shard the sequence zig-zag (the ring's load-balanced layout); adaptive
#: chooses among algorithms of this layout per call, so the data split never changes.
ZIGZAG_ALGOS = (RING, KVALLGATHER, ADAPTIVE)

Ranges = tuple[tuple[int, int], ...]


def check_algo(algo: str) -> None:
    """Raise ``ValueError`` naming the known algorithms when ``algo`` is not one of them."""
    if algo not in ALGOS:
        raise ValueError(f"unknown context_parallel_algo {algo!r}; use one of: {', '.join(ALGOS)}")


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal chunks of ``length`` (the first ``length % parts`` are one longer).

    Args:
        length: number of items to split.
        parts: number of chunks (>= 1).

    Returns:
        ``parts`` sizes summing to ``length``.
    """
    if parts < 1 or length < 0:
        raise ValueError(f"cannot split {length} items into {parts} parts")
    base, extra = divmod(length, parts)
    return [base + (i < extra) for i in range(parts)]


def _chunk_ranges(length: int, parts: int) -> list[tuple[int, int]]:
    bounds = [0]
    for size in split_sizes(length, parts):
        bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:]))


def zigzag_ranges(seq_len: int, rank: int, size: int) -> Ranges:
    """Chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` (the ring's load-balanced layout)."""
    chunks = _chunk_ranges(seq_len, 2 * size)
    return (chunks[rank], chunks[2 * size - 1 - rank])


def take_local(ranges: Ranges, start: int, stop: int) -> Ranges:
    """The global ranges behind local offsets ``[start, stop)`` of a shard made of ``ranges``."""
    taken, offset = [], 0
    for lo, hi in ranges:
        length = hi - lo
        a, b = max(start - offset, 0), min(stop - offset, length)
        if a < b:
            taken.append((lo + a, lo + b))
        offset += length
    return tuple(taken)


def ranges_length(ranges: Ranges) -> int:
    """Number of positions in ``ranges``."""
    return sum(hi - lo for lo, hi in ranges)


def check_degrees(cp_size: int, algo: str, ulysses_degree: int) -> None:
    """Raise ``ValueError`` when ``ulysses_degree`` does not fit ``cp_size`` and ``algo``."""
    check_algo(algo)
    if cp_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {cp_size}")
    if algo == HYBRID and (ulysses_degree < 1 or cp_size % ulysses_degree != 0):
        raise ValueError(
            f"hybrid_cp_algo needs ulysses_degree_in_cp ({ulysses_degree}) to divide context_parallel_size ({cp_size})"
        )


def check_window_size(cp_size: int, algo: str, cp_window_size: int) -> None:
    """Raise ``ValueError`` when the double ring's window ``cp_window_size`` does not fit ``cp_size`` and ``algo``."""
    if cp_window_size == 1:
        return
    if algo not in (RING, ADAPTIVE):
        raise ValueError(
            f"cp_window_size={cp_window_size} (double ring) needs megatron_cp_algo, not {algo}; set it to 1"
        )
    if not 1 < cp_window_size < cp_size or cp_size % cp_window_size:
        raise ValueError(
            f"cp_window_size={cp_window_size} must divide context_parallel_size={cp_size} and be below it "
            "(1 is the plain ring)"
        )


def shard_ranges(seq_len: int, cp_rank: int, cp_size: int, algo: str, ulysses_degree: int = 1) -> Ranges:
    """The global position ranges CP rank ``cp_rank`` holds, in local order.

    Args:
        seq_len: length of the whole (unsplit) sequence.
        cp_rank: rank in the CP group (for ``hybrid_cp_algo``: ``ring_rank * U + ulysses_rank``).
        cp_size: CP degree ``C``.
        algo: ``ulysses_cp_algo``, ``megatron_cp_algo`` or ``hybrid_cp_algo``.
        ulysses_degree: ``U`` for ``hybrid_cp_algo`` (ignored otherwise).

    Returns:
        ``((start, stop), ...)``; concatenating these slices gives the rank's shard.
    """
    check_degrees(cp_size, algo, ulysses_degree)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the CP group of size {cp_size}")
    if algo == ULYSSES:
        return (_chunk_ranges(seq_len, cp_size)[cp_rank],)
    if algo in ZIGZAG_ALGOS:
        return zigzag_ranges(seq_len, cp_rank, cp_size)
    ring_size = cp_size // ulysses_degree
    ring_rank, ulysses_rank = divmod(cp_rank, ulysses_degree)
    ring_shard = zigzag_ranges(seq_len, ring_rank, ring_size)
    start, stop = _chunk_ranges(ranges_length(ring_shard), ulysses_degree)[ulysses_rank]
    return take_local(ring_shard, start, stop)


def shard_lengths(seq_len: int, cp_size: int, algo: str, ulysses_degree: int = 1) -> list[int]:
    """The local sequence length of every CP rank, in CP-rank order."""
    return [ranges_length(shard_ranges(seq_len, r, cp_size, algo, ulysses_degree)) for r in range(cp_size)]


def _narrow_cat(tensor: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    pieces = [tensor.narrow(dim, lo, hi - lo) for lo, hi in ranges if hi > lo]
    if not pieces:
        return tensor.narrow(dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def split_for_context_parallel(
    tensor: torch.Tensor, dim: int, cp_rank: int, cp_size: int, algo: str, *, ulysses_degree: int = 1
) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor (input ids, labels, position ids, embeddings).

    The data side calls this with the same arguments for every per-token tensor, so tokens,
    labels and position ids line up with the attention's layout. Megatron's activations are
    ``[s, b, ...]`` (``dim=0``); token batches are ``[b, s]`` (``dim=1``).

    Args:
        tensor: the unsplit tensor; ``tensor.size(dim)`` is the sequence length.
        dim: the sequence dimension.
        cp_rank: rank in the CP group (for ``hybrid_cp_algo``: ``ring_rank * U + ulysses_rank``,
            which is the CP-group rank when the sub-groups come from
            :func:`~mindspeed.parallel.context_parallel.groups.build_context_parallel_groups`).
        cp_size: CP degree.
        algo: the CP algorithm (MindSpeed's name).
        ulysses_degree: ``U`` for ``hybrid_cp_algo``.

    Returns:
        The rank's shard (a view when it is one contiguous range, else a copy).
    """
    ranges = shard_ranges(tensor.size(dim), cp_rank, cp_size, algo, ulysses_degree)
    return _narrow_cat(tensor, dim, ranges)


class _GatherSequence(torch.autograd.Function):
    """All-gather of uneven shards; backward sums the gradients of every rank, then slices."""

    @staticmethod
    def forward(ctx, local, dim, group, all_ranges, rank):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.ranges = dim, group, all_ranges[rank]
        lengths = [ranges_length(r) for r in all_ranges]
        longest = max(lengths)
        # Gloo's all_gather needs equal sizes: pad every shard to the longest one.
        padded = local.new_zeros(*local.shape[:dim], longest, *local.shape[dim + 1 :])
        padded.narrow(dim, 0, local.size(dim)).copy_(local)
        buffers = [torch.empty_like(padded) for _ in all_ranges]
        dist.all_gather(buffers, padded.contiguous(), group=group)
        seq_len = sum(lengths)
        full = local.new_empty(*local.shape[:dim], seq_len, *local.shape[dim + 1 :])
        for buffer, ranges in zip(buffers, all_ranges):
            offset = 0
            for lo, hi in ranges:
                full.narrow(dim, lo, hi - lo).copy_(buffer.narrow(dim, offset, hi - lo))
                offset += hi - lo
        return full

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return _narrow_cat(grad, ctx.dim, ctx.ranges), None, None, None, None


def gather_from_context_parallel(
    tensor: torch.Tensor,
    dim: int,
    cp_group: dist.ProcessGroup,
    algo: str,
    *,
    seq_len: int | None = None,
    ulysses_degree: int = 1,
) -> torch.Tensor:
    """Reassemble the full sequence from every CP rank's shard (the inverse of the split).

    Differentiable: the gradient of the full tensor is summed over the CP ranks (each may use
    it differently) and each rank keeps its own positions.

    Args:
        tensor: this rank's shard.
        dim: the sequence dimension.
        cp_group: the CP process group (its ranks, in order, are the CP ranks).
        algo: the CP algorithm the shard was split with.
        seq_len: the full length; needed when it is not ``local length * C`` (unaligned).
        ulysses_degree: ``U`` for ``hybrid_cp_algo``.

    Returns:
        The full tensor, on every rank.
    """
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    seq_len = tensor.size(dim) * cp_size if seq_len is None else seq_len
    all_ranges = [shard_ranges(seq_len, r, cp_size, algo, ulysses_degree) for r in range(cp_size)]
    if ranges_length(all_ranges[cp_rank]) != tensor.size(dim):
        raise ValueError(
            f"CP rank {cp_rank} holds {tensor.size(dim)} positions but {algo} over {cp_size} ranks of a "
            f"{seq_len}-token sequence gives it {ranges_length(all_ranges[cp_rank])}; pass the full seq_len"
        )
    if cp_size == 1:
        return tensor
    return _GatherSequence.apply(tensor, dim, cp_group, all_ranges, cp_rank)


def positions_for_context_parallel(
    seq_len: int, cp_rank: int, cp_size: int, algo: str, *, ulysses_degree: int = 1, device=None
) -> torch.Tensor:
    """Global positions of this rank's tokens (for rotary embeddings when ids are not split).

    Args:
        seq_len: full sequence length.
        cp_rank: rank in the CP group.
        cp_size: CP degree.
        algo: the CP algorithm.
        ulysses_degree: ``U`` for ``hybrid_cp_algo``.
        device: where to build the tensor.

    Returns:
        A long tensor of the rank's positions in local order.
    """
    ranges = shard_ranges(seq_len, cp_rank, cp_size, algo, ulysses_degree)
    if not ranges:
        return torch.arange(0, device=device)
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges])


def packed_shard_ranges(bounds: Sequence[int], cp_rank: int, cp_size: int) -> Ranges:
    """The global ranges CP rank ``cp_rank`` holds of a packed row split sequence by sequence.

    Megatron's THD layout under context parallelism (what its rope assumes): every packed
    sequence ``[b_i, b_{i+1})`` is cut into ``2 * C`` equal chunks and rank ``r`` holds chunks
    ``r`` and ``2 * C - 1 - r`` of each, sequence after sequence. The ranges ascend, so local
    order is global order.

    Args:
        bounds: global boundaries of the packed sequences (``cu_seqlens``); every length must be
            a multiple of ``2 * cp_size``.
        cp_rank: rank in the CP group.
        cp_size: CP degree ``C``.

    Raises:
        ValueError: a sequence length is not a multiple of ``2 * cp_size``.
    """
    ranges: list[tuple[int, int]] = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if (stop - start) % (2 * cp_size):
            raise ValueError(
                f"packed sequence [{start}, {stop}) has {stop - start} tokens, not a multiple of "
                f"2 * context_parallel_size = {2 * cp_size}; pad every packed sequence to a multiple"
            )
        ranges.extend((lo + start, hi + start) for lo, hi in zigzag_ranges(stop - start, cp_rank, cp_size) if hi > lo)
    return tuple(ranges)


def split_packed_for_context_parallel(
    tensor: torch.Tensor, dim: int, bounds: Sequence[int], cp_rank: int, cp_size: int
) -> torch.Tensor:
    """This rank's shard of a packed (THD) row: :func:`packed_shard_ranges` of ``bounds``, concatenated."""
    return _narrow_cat(tensor, dim, packed_shard_ranges(tuple(int(b) for b in bounds), cp_rank, cp_size))


def check_cu_seqlens(cu_seqlens: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """Validate global packed-sequence boundaries and return them as a tuple.

    Raises:
        ValueError: unless they rise from 0 to ``seq_len``.
    """
    bounds = tuple(int(b) for b in cu_seqlens)
    rising = all(a <= b for a, b in zip(bounds, bounds[1:]))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len or not rising:
        raise ValueError(
            f"cu_seqlens must be the GLOBAL boundaries of the packed row, rising from 0 to seq_len={seq_len}; "
            f"got {list(bounds)}"
        )
    return bounds
