"""Sequence-length balancing: split variable-length rows into groups with even token counts.

Rollouts return responses of very different lengths; cutting a batch into micro-batches (or
data-parallel shares) by position leaves one rank with most of the tokens. The largest
differencing method (Karmarkar-Karp, generalised to k sets, as verl's ``seqlen_balancing``
uses) evens the token sums: every item starts as its own partial solution, and the two
solutions with the largest spread are merged, largest set of one with smallest of the other,
until one solution is left.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence


class _Solution:
    """k sets of item indices with their sums, kept sorted by sum (largest first)."""

    def __init__(self, sets: list[list[int]], sums: list[int]) -> None:
        order = sorted(range(len(sums)), key=lambda j: -sums[j])
        self.sets = [sets[j] for j in order]
        self.sums = [sums[j] for j in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: _Solution) -> _Solution:
        k = len(self.sums)
        return _Solution(
            [self.sets[j] + other.sets[k - 1 - j] for j in range(k)],
            [self.sums[j] + other.sums[k - 1 - j] for j in range(k)],
        )


def balanced_partitions(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices ``0..n-1`` into ``k`` sets with near-equal sums of ``seqlens``.

    Args:
        seqlens: the weight (token count) of each item.
        k: number of sets.
        equal_size: every set gets exactly ``n / k`` items (data-parallel ranks that must run
            the same number of micro-batches); ``n`` must be a multiple of ``k``.

    Returns:
        ``k`` lists of indices, each sorted; every index appears exactly once.

    Raises:
        ValueError: ``k < 1``, fewer items than sets, or ``n`` not a multiple of ``k`` with ``equal_size``.
    """
    n = len(seqlens)
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} sequences into {k} non-empty groups")
    if equal_size and n % k:
        raise ValueError(f"equal-size groups need the {n} sequences to be a multiple of {k}")
    order = sorted(range(n), key=lambda i: (-seqlens[i], i))
    counter = itertools.count()  # tie-breaker: the heap never compares solutions
    heap: list[tuple[int, int, _Solution]] = []
    if equal_size:
        # k items at a time, one per set, so every merge keeps the set sizes equal.
        for start in range(0, n, k):
            chunk = order[start : start + k]
            solution = _Solution([[i] for i in chunk], [seqlens[i] for i in chunk])
            heapq.heappush(heap, (-solution.spread, next(counter), solution))
    else:
        for i in order:
            solution = _Solution([[i]] + [[] for _ in range(k - 1)], [seqlens[i]] + [0] * (k - 1))
            heapq.heappush(heap, (-solution.spread, next(counter), solution))
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = first.merge(second)
        heapq.heappush(heap, (-merged.spread, next(counter), merged))
    return [sorted(s) for s in heap[0][2].sets]


def micro_batches_by_tokens(
    seqlens: Sequence[int], max_tokens: int, min_count: int = 1, multiple_of: int = 1
) -> list[list[int]]:
    """Fewest balanced micro-batches with at most ``max_tokens`` tokens each (dynamic batch size).

    Starts from ``ceil(total / max_tokens)`` micro-batches and adds one until every balanced
    split fits (verl's ``rearrange_micro_batches``).

    Args:
        seqlens: tokens of each sequence.
        max_tokens: the token budget of one micro-batch.
        min_count: at least this many micro-batches (e.g. pipeline stages).
        multiple_of: the count is rounded up to a multiple of this (e.g. so that every
            data-parallel rank gets the same number).

    Returns:
        Lists of sequence indices, the heaviest micro-batch first.

    Raises:
        ValueError: a sequence longer than ``max_tokens``.
    """
    longest = max(seqlens, default=0)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens does not fit micro-batches of max_tokens={max_tokens}; "
            "raise the token budget"
        )
    if not seqlens:
        return []
    count = max(min_count, math.ceil(sum(seqlens) / max_tokens))
    while True:
        count = min(-(-count // multiple_of) * multiple_of, len(seqlens))
        parts = balanced_partitions(seqlens, count)
        if all(sum(seqlens[i] for i in part) <= max_tokens for part in parts) or count == len(seqlens):
            return sorted(parts, key=lambda part: -sum(seqlens[i] for i in part))
        count += 1
