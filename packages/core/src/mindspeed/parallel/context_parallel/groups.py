"""The process groups of context parallelism, as values."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mindspeed.parallel.context_parallel.layout import (
    ADAPTIVE,
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    check_degrees,
    check_window_size,
)


@dataclass(frozen=True)
class ContextParallelGroups:
    """The groups one rank's CP attention uses.

    Attributes:
        cp_group: the whole CP group.
        ulysses_group: the group that splits heads (the CP group for Ulysses, ``U``
            consecutive CP ranks for hybrid, ``None`` for ring).
        ring_group: the ring (the CP group for ring, the CP ranks with this rank's Ulysses rank
            for hybrid, ``None`` for Ulysses and KV all-gather, which use ``cp_group`` itself).
        inner_ring_group: the double ring's window (``cp_window_size`` consecutive CP ranks),
            ``None`` without a window.
        outer_ring_group: the double ring's outer ring (the CP ranks with this rank's inner
            rank, stride ``cp_window_size``), ``None`` without a window.
    """

    cp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None
    inner_ring_group: dist.ProcessGroup | None = None
    outer_ring_group: dist.ProcessGroup | None = None

    @property
    def cp_rank(self) -> int:
        """This rank's CP rank: the one to pass to ``split_for_context_parallel``."""
        return dist.get_rank(self.cp_group)

    @property
    def cp_size(self) -> int:
        """The CP degree."""
        return dist.get_world_size(self.cp_group)


def _subgroup(cp_group: dist.ProcessGroup, members: list[int]) -> dist.ProcessGroup:
    if members == dist.get_process_group_ranks(cp_group):
        return cp_group
    return dist.new_group(members, use_local_synchronization=True)


def build_context_parallel_groups(
    cp_group: dist.ProcessGroup, algo: str, ulysses_degree: int | None = None, cp_window_size: int = 1
) -> ContextParallelGroups:
    """The Ulysses and ring groups of ``cp_group`` for ``algo``.

    For ``hybrid_cp_algo`` the CP ranks ``0 .. C-1`` form Ulysses groups of ``U`` consecutive
    ranks and ring groups of stride ``U`` (MindSpeed's arrangement), so CP rank ``c`` is ring
    rank ``c // U`` and Ulysses rank ``c % U``. Only the members of a new group create it
    (``use_local_synchronization``), so each CP group can build its own sub-groups
    independently of the others.

    Args:
        cp_group: this rank's CP group.
        algo: ``ulysses_cp_algo``, ``megatron_cp_algo``, ``hybrid_cp_algo`` or ``kvallgather_cp_algo``.
        ulysses_degree: ``U`` for ``hybrid_cp_algo``.
        cp_window_size: ``w > 1`` makes the ring (``megatron_cp_algo``, ``adaptive_cp_algo``) a
            double ring: windows of ``w`` consecutive CP ranks (the inner rings) and outer rings
            of stride ``w``, the same arrangement as hybrid's Ulysses and ring groups.

    Returns:
        The groups of this rank.
    """
    cp_size = dist.get_world_size(cp_group)
    check_degrees(cp_size, algo, ulysses_degree or 1)
    check_window_size(cp_size, algo, cp_window_size)
    if algo == ULYSSES:
        return ContextParallelGroups(cp_group, ulysses_group=cp_group)
    if algo in (RING, ADAPTIVE):
        if cp_window_size == 1:
            return ContextParallelGroups(cp_group, ring_group=cp_group)
        ranks = dist.get_process_group_ranks(cp_group)
        window, inner = divmod(dist.get_rank(cp_group), cp_window_size)
        # Every rank creates its window first, then its outer ring: members agree on the order.
        inner_group = _subgroup(cp_group, ranks[window * cp_window_size : (window + 1) * cp_window_size])
        outer_group = _subgroup(cp_group, ranks[inner::cp_window_size])
        return ContextParallelGroups(
            cp_group, ring_group=cp_group, inner_ring_group=inner_group, outer_ring_group=outer_group
        )
    if algo == KVALLGATHER:
        return ContextParallelGroups(cp_group)
    assert algo == HYBRID
    if ulysses_degree is None:
        raise ValueError("hybrid_cp_algo needs ulysses_degree (ulysses_degree_in_cp)")
    ranks = dist.get_process_group_ranks(cp_group)
    ring_rank, ulysses_rank = divmod(dist.get_rank(cp_group), ulysses_degree)
    ulysses_ranks = ranks[ring_rank * ulysses_degree : (ring_rank + 1) * ulysses_degree]
    ring_ranks = ranks[ulysses_rank::ulysses_degree]

    # Every rank creates its Ulysses group first, then its ring group: members agree on the order.
    return ContextParallelGroups(
        cp_group, ulysses_group=_subgroup(cp_group, ulysses_ranks), ring_group=_subgroup(cp_group, ring_ranks)
    )
