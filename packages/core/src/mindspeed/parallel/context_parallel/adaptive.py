"""Adaptive context parallelism (``adaptive_cp_algo``): the algorithm chosen from the mask's block sparsity.

MindSpeed's ``adaptive_cp_algo`` looks at the attention mask, remaps the sequence so that
masked-out blocks can be skipped, and decides per block whether it has to move. Here the
sequence layout stays the ring's zig-zag (megatron's rope and data split need it, see
docs/core/context-parallel.md), and what adapts is **which algorithm runs on that layout**:
all three candidates below share it, so the choice can be made per call (per packed
microbatch, per layer kind) without touching the data.

The rule (:func:`choose_cp_algo`) counts, for every pair of CP ranks ``(r, s)``, whether any
query of ``r`` may attend any key of ``s`` (the non-empty blocks of the ``C x C`` block mask,
the blocks of :func:`~mindspeed.parallel.context_parallel.blocks.plan_blocks` and a window's
reach):

1. a sliding window: ``kvallgather_cp_algo``, the one algorithm that takes one. ALiBi takes
   the rule below like any mask (the ring biases every block by its global positions, the
   KV all-gather and ``local`` by theirs), except that ALiBi without a causal mask goes to the
   ring when the rule says KV all-gather (which takes ALiBi under a causal mask only);
2. no non-empty block off the diagonal (every packed document lies inside one rank's
   chunk): ``local``, each rank attends its own shard and **nothing is communicated**;
3. the ring's step ``d`` (every rank ``r`` meeting the keys of ``r - d``) is *used* when some
   rank has a non-empty block there. If at least half of the ``C - 1`` steps are used,
   ``megatron_cp_algo`` (the ring: ``O(S / C)`` memory, transfers overlapped with the
   blocks they feed); otherwise ``kvallgather_cp_algo``: the ring would mostly wait on
   transfers with no block to hide them behind, while one all-gather moves the same bytes in
   a single collective.

Every choice computes the same attention, so the result equals CP1 whichever is taken.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mindspeed.parallel.context_parallel.blocks import plan_blocks
from mindspeed.parallel.context_parallel.layout import KVALLGATHER, RING, packed_shard_ranges, zigzag_ranges

#: Each rank attends its own shard only (no cross-rank block is visible).
LOCAL = "local"


@dataclass(frozen=True)
class AdaptiveChoice:
    """What :func:`choose_cp_algo` picked and the counts it picked by.

    Attributes:
        algo: ``"local"``, ``megatron_cp_algo`` or ``kvallgather_cp_algo``.
        visible: ``visible[r][s]``: some query of CP rank ``r`` sees some key of rank ``s``.
        used_steps: ring steps ``d = 1 .. C-1`` with a non-empty block on some rank.
        reason: one line for logs and reports.
    """

    algo: str
    visible: tuple[tuple[bool, ...], ...]
    used_steps: int
    reason: str

    @property
    def blocks(self) -> int:
        """Non-empty blocks of the ``C x C`` block mask (the diagonal included)."""
        return sum(sum(row) for row in self.visible)


def _reaches(q_ranges, k_ranges, left: int) -> bool:
    """Some key of ``k_ranges`` lies within ``left`` positions before some query of ``q_ranges``."""
    return any(max(ya, xa - left) < min(yb, xb) for xa, xb in q_ranges if xb > xa for ya, yb in k_ranges if yb > ya)


@functools.lru_cache(maxsize=256)
def choose_cp_algo(
    seq_len: int,
    cp_size: int,
    causal: bool,
    bounds: tuple[int, ...] | None = None,
    window_size: tuple[int, int] = (-1, -1),
    alibi: bool = False,
    per_sequence: bool = False,
) -> AdaptiveChoice:
    """The algorithm ``adaptive_cp_algo`` runs for this mask (the rule is in the module doc).

    Args:
        seq_len: length of the whole sequence.
        cp_size: CP degree ``C``.
        causal: causal mask.
        bounds: global packed-sequence boundaries, or ``None``.
        window_size: ``(left, right)`` sliding window by global position (``(-1, -1)``: none).
        alibi: ALiBi slopes are given.
        per_sequence: packed sequences are each split zig-zag (megatron's THD layout).

    Returns:
        The :class:`AdaptiveChoice`.
    """
    if per_sequence and bounds is not None:
        shards = [packed_shard_ranges(bounds, r, cp_size) for r in range(cp_size)]
    else:
        shards = [zigzag_ranges(seq_len, r, cp_size) for r in range(cp_size)]
    left = window_size[0] if tuple(window_size) != (-1, -1) else -1
    visible = []
    for r in range(cp_size):
        row = []
        for s in range(cp_size):
            blocks = plan_blocks(shards[r], shards[s], seq_len=seq_len, causal=causal, bounds=bounds)
            seen = bool(blocks)
            if seen and left >= 0 and r != s:
                seen = _reaches(shards[r], shards[s], left)
            row.append(seen)
        visible.append(tuple(row))
    used = sum(any(visible[r][(r - d) % cp_size] for r in range(cp_size)) for d in range(1, cp_size))
    if left >= 0:
        algo, reason = KVALLGATHER, "a sliding window: only the KV all-gather takes one"
    elif used == 0:
        algo, reason = LOCAL, "no block off the diagonal is visible: each rank attends its own shard"
    elif 2 * used >= cp_size - 1:
        algo, reason = RING, f"{used} of {cp_size - 1} ring steps have blocks to compute"
    elif alibi and not causal:
        algo, reason = (
            RING,
            f"only {used} of {cp_size - 1} ring steps are used, but the KV all-gather takes ALiBi causal only",
        )
    else:
        algo, reason = KVALLGATHER, f"only {used} of {cp_size - 1} ring steps have blocks to compute"
    return AdaptiveChoice(algo=algo, visible=tuple(visible), used_steps=used, reason=reason)
