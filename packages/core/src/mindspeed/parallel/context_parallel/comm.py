"""Communication of context parallelism: Ulysses all-to-all with autograd, ring send/receive.

Everything takes its process group as an argument. Messages are BSND tensors
(``[batch, seq, heads, dim]``); the all-to-all supports uneven sequence shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _seq_to_heads(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, seq_sizes: Sequence[int]) -> list:
    """Scatter heads, gather the sequence: ``[b, s_r, h_t, d]`` each -> ``[b, sum(seq_sizes), h_t / U, d]``.

    Several tensors (q, k, v) travel in one all-to-all: per destination rank their head
    groups are laid side by side, so one collective replaces three.
    """
    world, rank = len(seq_sizes), dist.get_rank(group)
    batch, seq, _, dim = tensors[0].shape
    if seq != seq_sizes[rank]:
        raise ValueError(
            f"Ulysses rank {rank} holds {seq} positions, expected {seq_sizes[rank]} (sizes {list(seq_sizes)})"
        )
    heads = [t.shape[2] // world for t in tensors]
    # [U, b, s, sum(heads), d]: block j holds the heads that rank j will own.
    send = torch.cat([t.reshape(batch, seq, world, h, dim) for t, h in zip(tensors, heads)], dim=3)
    send = send.permute(2, 0, 1, 3, 4).contiguous()
    width = sum(heads)
    recv = send.new_empty(batch * sum(seq_sizes) * width * dim)
    dist.all_to_all_single(
        recv,
        send.reshape(-1),
        output_split_sizes=[batch * s * width * dim for s in seq_sizes],
        input_split_sizes=[batch * seq_sizes[rank] * width * dim] * world,
        group=group,
    )
    pieces = recv.split([batch * s * width * dim for s in seq_sizes])
    full = torch.cat([p.view(batch, s, width, dim) for p, s in zip(pieces, seq_sizes)], dim=1)
    return list(full.split(heads, dim=2))


def _heads_to_seq(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, seq_sizes: Sequence[int]) -> list:
    """The inverse: ``[b, sum(seq_sizes), h, d]`` each -> ``[b, s_r, h * U, d]``."""
    world, rank = len(seq_sizes), dist.get_rank(group)
    batch, _, _, dim = tensors[0].shape
    heads = [t.shape[2] for t in tensors]
    width = sum(heads)
    joined = torch.cat(list(tensors), dim=2) if len(tensors) > 1 else tensors[0]
    # Destination j gets its sequence piece; pieces are contiguous after the flatten.
    send = torch.cat([p.reshape(-1) for p in joined.split(list(seq_sizes), dim=1)])
    local = seq_sizes[rank]
    recv = send.new_empty(world * batch * local * width * dim)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[batch * local * width * dim] * world,
        input_split_sizes=[batch * s * width * dim for s in seq_sizes],
        group=group,
    )
    # [U (source = head group), b, s_r, width, d] -> per tensor [b, s_r, U * h, d].
    recv = recv.view(world, batch, local, width, dim)
    outs = []
    for part in recv.split(heads, dim=3):
        outs.append(part.permute(1, 2, 0, 3, 4).reshape(batch, local, world * part.shape[3], dim))
    return outs


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, seq_sizes, *tensors):  # type: ignore[override]
        ctx.group, ctx.seq_sizes = group, seq_sizes
        return tuple(_seq_to_heads(tensors, group, seq_sizes))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, *_heads_to_seq([g.contiguous() for g in grads], ctx.group, ctx.seq_sizes))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, seq_sizes, *tensors):  # type: ignore[override]
        ctx.group, ctx.seq_sizes = group, seq_sizes
        return tuple(_heads_to_seq(tensors, group, seq_sizes))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, *_seq_to_heads([g.contiguous() for g in grads], ctx.group, ctx.seq_sizes))


def seq_to_heads(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, seq_sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Ulysses' first all-to-all, differentiable: sequence shards with all heads -> full sequence, ``1/U`` of the heads.

    Args:
        tensors: BSND tensors with the same batch, local sequence and head dim; each one's head
            count divisible by the group size ``U``.
        group: the Ulysses group; its rank ``j`` receives heads ``[j * h / U, (j + 1) * h / U)``.
        seq_sizes: every rank's local sequence length, in group-rank order.

    Returns:
        ``[b, sum(seq_sizes), h / U, d]`` per input, the sequence in group-rank order.
    """
    if len(seq_sizes) == 1:
        return list(tensors)
    return list(_SeqToHeads.apply(group, tuple(seq_sizes), *tensors))


def heads_to_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, seq_sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Ulysses' second all-to-all, differentiable: the inverse of :func:`seq_to_heads`.

    Args:
        tensors: ``[b, sum(seq_sizes), h, d]`` tensors.
        group: the Ulysses group.
        seq_sizes: every rank's local sequence length, in group-rank order.

    Returns:
        ``[b, seq_sizes[rank], h * U, d]`` per input.
    """
    if len(seq_sizes) == 1:
        return list(tensors)
    return list(_HeadsToSeq.apply(group, tuple(seq_sizes), *tensors))


class RingExchange:
    """Sends a tensor to the next rank of a ring and receives one from the previous, asynchronously.

    :meth:`start` posts both transfers with ``batch_isend_irecv`` and returns their handles at
    once, so the caller computes while the message moves; :meth:`wait` blocks on the handles.
    Different message kinds use different tags (gloo matches on them; NCCL and HCCL keep
    issue order, which is the same on every rank).

    Args:
        group: the ring's process group; neighbours are group ranks ``r + 1`` and ``r - 1``.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
        """Post the send of ``send`` to the next rank and the receive into ``recv`` from the previous.

        Returns:
            The handles to pass to :meth:`wait`.
        """
        ops = [
            dist.P2POp(dist.isend, send, self.next_rank, group=self.group, tag=tag),
            dist.P2POp(dist.irecv, recv, self.prev_rank, group=self.group, tag=tag),
        ]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(handles: list) -> None:
        """Block until the transfers behind ``handles`` are complete."""
        for handle in handles:
            handle.wait()
