"""Which attention calls cover a (query shard, key shard) pair exactly.

Ring attention computes, at every step, the local queries against one rank's keys. The
visible (query, key) pairs are those in the same packed sequence and, under a causal mask,
with the key at or before the query. This module turns that set into a few calls of the
``attention`` op, each over a rectangle of local rows and key rows:

- the rank's own keys (the diagonal): one call over the whole shard, ``causal`` as asked and
  the packed-sequence boundaries translated to local offsets. Local order is ascending in
  global position, so a causal mask by local index is the causal mask by position, even
  across the two zig-zag chunks.
- another rank's keys: shards are unions of contiguous chunks, and for a query chunk ``X``
  and a disjoint key chunk ``Y`` at most one packed sequence can contain positions of both
  (sequences are intervals), so the visible pairs of ``(X, Y)`` form one full rectangle: a
  prefix of ``X`` and a suffix of ``Y`` when ``Y`` comes first, the reverse otherwise (none
  under a causal mask). Without packing that sequence is the whole row, so the rectangle is
  the whole chunk pair. Rectangles that touch are then merged, which gives the classic zig-zag
  schedule: queries against the first half of an earlier rank's keys, or the second half of
  the queries against all keys of a later rank, in one call each.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from mindspeed.parallel.context_parallel.layout import Ranges


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step, in local offsets.

    Attributes:
        q_start: first local query row.
        q_stop: one past the last local query row.
        k_start: first local key row of the key shard.
        k_stop: one past the last local key row.
        causal: causal mask by local index (only on the diagonal).
        cu_seqlens: local packed-sequence boundaries (only on the diagonal), ``None`` when the
            rows are one sequence.
        q_pos: global position of the first row, set by ``plan_blocks(..., contiguous=True)``
            (the rows are then consecutive positions), else ``None``.
        k_pos: global position of the first key, likewise.
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    q_pos: int | None = None
    k_pos: int | None = None

    def alibi_offset(self) -> int:
        """The ``attention`` op's ``alibi_offset`` that puts this block's rows and keys at their global positions.

        The op places query ``i`` of ``n_q`` at key index ``i + n_k - n_q + offset``; the block's
        row ``i`` is at ``q_pos + i`` and key ``j`` at ``k_pos + j``, so the offset is
        ``q_pos - k_pos - (n_k - n_q)``.
        """
        if self.q_pos is None or self.k_pos is None:
            raise ValueError("the block has no global positions; plan it with plan_blocks(..., contiguous=True)")
        return self.q_pos - self.k_pos - ((self.k_stop - self.k_start) - (self.q_stop - self.q_start))


def _segment(bounds: tuple[int, ...], position: int) -> tuple[int, int]:
    """The packed sequence ``[start, stop)`` that holds ``position``."""
    index = bisect.bisect_right(bounds, position) - 1
    return bounds[index], bounds[index + 1]


def _chunks(ranges: Ranges) -> list[tuple[int, int, int]]:
    """``(start, stop, local offset)`` of each non-empty range."""
    found, offset = [], 0
    for lo, hi in ranges:
        if hi > lo:
            found.append((lo, hi, offset))
        offset += hi - lo
    return found


def local_cu_seqlens(ranges: Ranges, bounds: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Packed-sequence boundaries of a shard in local offsets (``None``: one sequence).

    Args:
        ranges: the shard's global ranges, ascending.
        bounds: global boundaries (``None``: no packing).

    Returns:
        Rising local boundaries from 0 to the shard length, or ``None``.
    """
    if bounds is None:
        return None
    local = {0}
    previous_end = None
    length = 0
    for lo, hi, offset in _chunks(ranges):
        local.update(b - lo + offset for b in bounds if lo < b < hi)
        if previous_end is not None and _segment(bounds, previous_end - 1) != _segment(bounds, lo):
            local.add(offset)  # the two chunks are in different sequences
        previous_end, length = hi, offset + hi - lo
    local.add(length)
    cu = tuple(sorted(local))
    return None if len(cu) <= 2 else cu


def _pair_block(
    x: tuple[int, int, int], y: tuple[int, int, int], bounds: tuple[int, ...], causal: bool
) -> Block | None:
    (xa, xb, ox), (ya, yb, oy) = x, y
    if yb <= xa:  # keys before queries: the sequence of the chunk's last key, if it reaches X
        start, stop = _segment(bounds, yb - 1)
        if stop <= xa:
            return None
        return Block(ox, ox + min(xb, stop) - xa, oy + max(ya, start) - ya, oy + yb - ya)
    if xb <= ya:  # keys after queries: invisible under a causal mask
        if causal:
            return None
        start, stop = _segment(bounds, xb - 1)
        if stop <= ya:
            return None
        return Block(ox + max(xa, start) - xa, ox + xb - xa, oy, oy + min(yb, stop) - ya)
    raise ValueError(f"query chunk {xa}:{xb} and key chunk {ya}:{yb} overlap; shards must be equal or disjoint")


def _merge(blocks: list[Block]) -> list[Block]:
    """Merge full rectangles that share one side and touch on the other."""
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(blocks):
            for j, b in enumerate(blocks):
                if i == j:
                    continue
                if (a.k_start, a.k_stop) == (b.k_start, b.k_stop) and a.q_stop == b.q_start:
                    joined = Block(a.q_start, b.q_stop, a.k_start, a.k_stop)
                elif (a.q_start, a.q_stop) == (b.q_start, b.q_stop) and a.k_stop == b.k_start:
                    joined = Block(a.q_start, a.q_stop, a.k_start, b.k_stop)
                else:
                    continue
                blocks = [blk for n, blk in enumerate(blocks) if n not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(blocks, key=lambda blk: (blk.q_start, blk.k_start))


def _placed(block: Block | None, x: tuple[int, int, int], y: tuple[int, int, int]) -> Block | None:
    """``block`` of the chunk pair ``(x, y)`` with the global positions of its first row and key."""
    if block is None:
        return None
    (xa, _, ox), (ya, _, oy) = x, y
    return replace(block, q_pos=xa + block.q_start - ox, k_pos=ya + block.k_start - oy)


def _contiguous_diagonal(ranges: Ranges, bounds: tuple[int, ...] | None, segments, causal: bool) -> list[Block]:
    """The shard against its own keys, one block per chunk pair (each side consecutive positions)."""
    blocks = []
    for x in _chunks(ranges):
        for y in _chunks(ranges):
            if x == y:
                (lo, hi, offset) = x
                cu = local_cu_seqlens(((lo, hi),), bounds)
                blocks.append(Block(offset, offset + hi - lo, offset, offset + hi - lo, causal, cu, lo, lo))
            elif (blk := _placed(_pair_block(x, y, segments, causal), x, y)) is not None:
                blocks.append(blk)
    return blocks


def plan_blocks(
    q_ranges: Ranges,
    k_ranges: Ranges,
    *,
    seq_len: int,
    causal: bool,
    bounds: tuple[int, ...] | None = None,
    contiguous: bool = False,
) -> list[Block]:
    """The attention calls that cover exactly the visible pairs of a query and a key shard.

    Args:
        q_ranges: global ranges of the query shard, ascending.
        k_ranges: global ranges of the key shard: the same shard, or a disjoint one.
        seq_len: length of the whole sequence.
        causal: causal mask by global position.
        bounds: global packed-sequence boundaries (``None``: one sequence).
        contiguous: one block per (query chunk, key chunk) pair, unmerged and the diagonal split
            too, each with its global positions (``Block.q_pos``, ``Block.k_pos``): what a
            position-dependent bias (ALiBi) needs, since a block's rows and keys are then
            consecutive positions. More, smaller calls.

    Returns:
        Blocks whose rectangles are disjoint; every visible pair is in exactly one of them.
    """
    q_len = sum(hi - lo for lo, hi in q_ranges)
    if q_len == 0:
        return []
    segments = bounds if bounds is not None else (0, seq_len)
    if tuple(q_ranges) == tuple(k_ranges):
        if contiguous:
            return _contiguous_diagonal(q_ranges, bounds, segments, causal)
        return [Block(0, q_len, 0, q_len, causal=causal, cu_seqlens=local_cu_seqlens(q_ranges, bounds))]
    if contiguous:
        placed = (
            _placed(_pair_block(x, y, segments, causal), x, y) for x in _chunks(q_ranges) for y in _chunks(k_ranges)
        )
        return sorted((blk for blk in placed if blk is not None), key=lambda blk: (blk.q_start, blk.k_start))
    blocks = [
        blk
        for x in _chunks(q_ranges)
        for y in _chunks(k_ranges)
        if (blk := _pair_block(x, y, segments, causal)) is not None
    ]
    return _merge(blocks)
