"""2D tensor parallelism: the tensor-parallel group as a ``tp_x x tp_y`` grid, and its collectives.

The TP rank ``r`` sits at ``(x, y) = divmod(r, tp_y)``: ``y`` is the fast axis, so the ranks of one
``y`` group are consecutive and the ranks of one ``x`` group are ``tp_y`` apart. Activations
between the linears of a layer are ``[s / tp_x, b, h / tp_y]``: rank ``(x, y)`` holds sequence
block ``x`` and hidden block ``y`` (MindSpeed's layout: the first dimension split over ``tp_x``,
the last over ``tp_y``). The differentiable collectives below move a tensor along one axis:
an all-gather whose backward is a reduce-scatter, a reduce-scatter whose backward is an
all-gather, and the enter / exit of the 2D layout from a tensor every TP rank holds whole.

Nothing here knows megatron; the process groups are values (:class:`Tp2dGroups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Tp2dGroups",
    "all_reduce_along",
    "all_gather_along",
    "build_tp2d_groups",
    "enter_2d",
    "exit_2d",
    "reduce_scatter_along",
    "slice_with_reduced_grad",
]


@dataclass(frozen=True)
class Tp2dGroups:
    """The two axes of one tensor-parallel group.

    Attributes:
        tp_x: ranks along x (the sequence split of activations; the output split of column weights).
        tp_y: ranks along y (the hidden split of activations; the input split of column weights).
        x_rank: this rank's index along x. y_rank: its index along y.
        x_group: the ``tp_x`` ranks that share this rank's ``y`` (collectives along x).
        y_group: the ``tp_y`` ranks that share this rank's ``x``.
        tp_group: the whole tensor-parallel group.
    """

    tp_x: int
    tp_y: int
    x_rank: int
    y_rank: int
    x_group: Any
    y_group: Any
    tp_group: Any

    @property
    def tp(self) -> int:
        """The tensor-parallel size, ``tp_x * tp_y``."""
        return self.tp_x * self.tp_y


# Sub-groups are created once per (TP group ranks, tp_x, tp_y): megatron builds every layer of
# a model with the same TP group, and ``new_group`` is collective over the world.
_CREATED: dict[tuple[tuple[int, ...], int, int], tuple[Any, Any]] = {}


def build_tp2d_groups(tp_group: Any, tp_x: int, tp_y: int) -> Tp2dGroups:
    """The ``tp_x x tp_y`` grid of ``tp_group`` (collective over the world on first use).

    Every world rank must call it (the TP groups of all data / pipeline replicas are created
    together, in one order); later calls with the same TP group return the same sub-groups.

    Raises:
        ValueError: ``tp_x * tp_y`` is not the size of ``tp_group``.
    """
    ranks = tuple(dist.get_process_group_ranks(tp_group))
    if tp_x * tp_y != len(ranks):
        raise ValueError(f"tp_x * tp_y = {tp_x} * {tp_y} != tensor-parallel size {len(ranks)}; choose tp_x * tp_y = tp")
    key = (ranks, tp_x, tp_y)
    if key not in _CREATED:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, ranks)
        mine: tuple[Any, Any] = (None, None)
        for group_ranks in sorted(set(every)):
            for x in range(tp_x):  # the y groups: one x, consecutive ranks
                members = [group_ranks[x * tp_y + y] for y in range(tp_y)]
                group = dist.new_group(members)
                if group_ranks == ranks and dist.get_rank() in members:
                    mine = (mine[0], group)
            for y in range(tp_y):  # the x groups: one y, ranks tp_y apart
                members = [group_ranks[x * tp_y + y] for x in range(tp_x)]
                group = dist.new_group(members)
                if group_ranks == ranks and dist.get_rank() in members:
                    mine = (group, mine[1])
        _CREATED[key] = mine
    x_group, y_group = _CREATED[key]
    x_rank, y_rank = divmod(ranks.index(dist.get_rank()), tp_y)
    return Tp2dGroups(tp_x, tp_y, x_rank, y_rank, x_group, y_group, tp_group)


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    rank = dist.get_rank(group)
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: all-reduce the whole tensor and keep this rank's block.
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size, dim=dim)[rank].contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _block(x: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    return x.chunk(parts, dim=dim)[index].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _gather(grad, ctx.dim, ctx.group), None, None


def all_gather_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` in group-rank order (backward: reduce-scatter)."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's block of ``dim`` (backward: all-gather)."""
    return _ReduceScatter.apply(x, dim, group)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
        ctx.groups = groups
        rows = _block(x, 0, groups.x_rank, groups.tp_x)
        return _block(rows, -1, groups.y_rank, groups.tp_y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = ctx.groups
        return _gather(_gather(grad, -1, g.y_group), 0, g.x_group), None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
        ctx.groups = groups
        return _gather(_gather(x, -1, groups.y_group), 0, groups.x_group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = ctx.groups
        return _block(_block(grad, 0, g.x_rank, g.tp_x), -1, g.y_rank, g.tp_y), None


def _sequence_to_hidden(x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
    # [s / tp, b, h] (TP rank x * tp_y + y holds sequence block x * tp_y + y) -> [s / tp_x, b, h / tp_y]:
    # the y group's sequence blocks are block x of tp_x; keep hidden block y (an all-to-all along y).
    return _block(_gather(x, 0, groups.y_group), -1, groups.y_rank, groups.tp_y)


def _hidden_to_sequence(x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
    # The inverse: [s / tp_x, b, h / tp_y] -> [s / tp, b, h] (sequence block y of the y group's rows).
    return _block(_gather(x, -1, groups.y_group), 0, groups.y_rank, groups.tp_y)


class _EnterFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
        ctx.groups = groups
        return _sequence_to_hidden(x, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _hidden_to_sequence(grad, ctx.groups), None


class _ExitToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
        ctx.groups = groups
        return _hidden_to_sequence(x, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _sequence_to_hidden(grad, ctx.groups), None


def enter_2d(x: torch.Tensor, groups: Tp2dGroups, sequence_parallel: bool = False) -> torch.Tensor:
    """``[s, b, h]`` held whole by every TP rank -> this rank's ``[s / tp_x, b, h / tp_y]`` block.

    The backward gathers the blocks' gradients over the grid, so every rank gets the whole
    gradient, as a replicated tensor's gradient is in 1D tensor parallelism. With
    ``sequence_parallel`` the input is megatron's sequence-parallel ``[s / tp, b, h]`` (TP rank
    ``r`` holds sequence block ``r``): an all-to-all along y, nothing along x.
    """
    s = x.shape[0] * (groups.tp if sequence_parallel else 1)
    if s % groups.tp_x or x.shape[-1] % groups.tp_y:
        raise ValueError(
            f"2D TP: hidden states {tuple(x.shape)} do not split into {groups.tp_x} sequence x {groups.tp_y} hidden "
            "blocks; use a sequence length divisible by tp_x and a hidden size divisible by tp_y"
        )
    return _EnterFromSequenceParallel.apply(x, groups) if sequence_parallel else _Enter.apply(x, groups)


def exit_2d(x: torch.Tensor, groups: Tp2dGroups, sequence_parallel: bool = False) -> torch.Tensor:
    """The inverse of :func:`enter_2d`: gather the blocks into ``[s, b, h]`` on every TP rank
    (with ``sequence_parallel``: into megatron's ``[s / tp, b, h]``)."""
    return _ExitToSequenceParallel.apply(x, groups) if sequence_parallel else _Exit.apply(x, groups)


class _SliceReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, index: int, parts: int, group: Any) -> torch.Tensor:
        ctx.index, ctx.parts, ctx.group, ctx.shape = index, parts, group, param.shape
        return _block(param, 0, index, parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        full = grad.new_zeros(ctx.shape)
        full.chunk(ctx.parts, dim=0)[ctx.index].copy_(grad)
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


def slice_with_reduced_grad(param: torch.Tensor, index: int, parts: int, group: Any) -> torch.Tensor:
    """Block ``index`` of ``parts`` of a parameter every TP rank holds whole (a norm weight, a row bias).

    The gradient is the whole parameter's, summed over ``group`` (the TP group): every rank
    used one block on its own tokens, and after the sum each holds the gradient 1D tensor
    parallelism would give the replicated parameter (the same on every rank).
    """
    return _SliceReduceGrad.apply(param, index, parts, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce_along(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``, on every rank (a statistic all of them use; backward: the same sum)."""
    return _AllReduce.apply(x, group)
