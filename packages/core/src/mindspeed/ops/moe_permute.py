"""MoE token permutation with a routing map: ``moe_permute`` and ``moe_unpermute``.

Semantics of megatron-core 0.16's ``moe_utils.permute`` / ``unpermute`` (routing-map form, no
drop-and-pad): ``routing_map [tokens, experts]`` says which experts each token goes to.
Permuting copies every routed (token, expert) pair to one row, expert-major: all of expert 0's
tokens in token order, then expert 1's, and so on; ``sorted_indices[row]`` is the row's token.
Unpermuting scatter-adds the rows back to their tokens, each scaled by its routing
probability when ``probs [tokens, experts]`` is given (gathered expert-major through the map).

Numerics: as in megatron, ``permuted * prob`` is computed in the promoted dtype of the two
(fp32 probabilities make an fp32 sum for bf16 tokens) and the result is cast back to the
dtype of ``permuted_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mindspeed.ops.registry import Case, OpSpec, register_kernel, register_op


def check_permute_args(tokens: torch.Tensor, routing_map: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tokens [T, H]`` and ``routing_map [T, E]`` fit together."""
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"moe_permute needs tokens [tokens, hidden] and routing_map [tokens, experts]; got tokens "
            f"{list(tokens.shape)} and routing_map {list(routing_map.shape)}"
        )


def check_num_out_tokens(num_out_tokens: int | None, num_rows: int) -> None:
    """Raise ``ValueError`` if a given ``num_out_tokens`` is not the number of routed pairs."""
    if num_out_tokens is not None and int(num_out_tokens) != num_rows:
        raise ValueError(
            f"moe_permute: num_out_tokens={num_out_tokens} but the routing map routes {num_rows} "
            "(token, expert) pairs; pass routing_map.sum() or None"
        )


def sorted_token_indices(routing_map: torch.Tensor) -> torch.Tensor:
    """The token of every permuted row, expert-major: ``int64 [routing_map.sum()]``."""
    num_tokens, num_experts = routing_map.shape
    mask = routing_map.bool().t().contiguous()  # [experts, tokens]
    token_ids = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    return token_ids.masked_select(mask)


def permuted_probs_of(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """The probability of every permuted row (expert-major, like :func:`sorted_token_indices`)."""
    if probs.shape != routing_map.shape:
        raise ValueError(
            f"moe_unpermute: probs {list(probs.shape)} and routing_map {list(routing_map.shape)} must "
            "both be [tokens, experts]"
        )
    return probs.t().contiguous().masked_select(routing_map.bool().t().contiguous())


def moe_permute_reference(
    tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy every routed token to one row per (token, expert), grouped by expert.

    Args:
        tokens: ``[tokens, hidden]``.
        routing_map: bool ``[tokens, experts]``; a token may go to any number of experts,
            none included.
        num_out_tokens: ``routing_map.sum()`` if the caller knows it (megatron's dispatcher
            does); checked against the map, ``None`` to skip.

    Returns:
        ``(permuted_tokens [rows, hidden], sorted_indices int64 [rows])`` with
        ``permuted_tokens[r] == tokens[sorted_indices[r]]``.

    Raises:
        ValueError: on inconsistent shapes or a wrong ``num_out_tokens``.
    """
    check_permute_args(tokens, routing_map)
    sorted_indices = sorted_token_indices(routing_map)
    check_num_out_tokens(num_out_tokens, sorted_indices.numel())
    return tokens.index_select(0, sorted_indices), sorted_indices


def check_unpermute_args(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None,
    routing_map: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` unless the arguments of ``moe_unpermute`` fit together."""
    if permuted_tokens.dim() != 2 or sorted_indices.shape != permuted_tokens.shape[:1]:
        raise ValueError(
            f"moe_unpermute needs permuted_tokens [rows, hidden] and sorted_indices [rows]; got "
            f"{list(permuted_tokens.shape)} and {list(sorted_indices.shape)}"
        )
    if len(restore_shape) != 2 or restore_shape[1] != permuted_tokens.shape[1]:
        raise ValueError(
            f"moe_unpermute: restore_shape {list(restore_shape)} must be [tokens, {permuted_tokens.shape[1]}]"
        )
    if probs is not None and routing_map is None:
        raise ValueError("moe_unpermute: probs need the routing_map that permuted the tokens")


def moe_unpermute_reference(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum the rows of every token back into place, each weighted by its routing probability.

    Args:
        permuted_tokens: ``[rows, hidden]``, as :func:`moe_permute_reference` ordered them.
        sorted_indices: int64 ``[rows]``, the token of each row.
        restore_shape: ``(tokens, hidden)`` of the result.
        probs: ``[tokens, experts]`` routing probabilities, or ``None`` (plain sum).
        routing_map: bool ``[tokens, experts]`` that produced the rows (needed with ``probs``).

    Returns:
        ``[tokens, hidden]`` in the dtype of ``permuted_tokens``; tokens routed nowhere are 0.
    """
    check_unpermute_args(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        permuted_tokens = permuted_tokens * permuted_probs_of(probs, routing_map).unsqueeze(-1)
    index = sorted_indices.unsqueeze(1).expand(-1, permuted_tokens.shape[1])
    out = torch.zeros(tuple(restore_shape), dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    return out.scatter_add(0, index, permuted_tokens).to(input_dtype)


# -- cases ---------------------------------------------------------------------------------------


def topk_routing_map(
    num_tokens: int, num_experts: int, topk: int, gen: torch.Generator, drop: bool = False
) -> torch.Tensor:
    """A random bool ``[tokens, experts]`` map with ``topk`` experts per token.

    With ``drop``, some tokens lose all their experts and some lose one (as capacity dropping
    does), so rows per token vary from 0 to ``topk``.
    """
    experts = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, experts, True)
    if drop:
        routing_map[::4] = False
        partly = torch.arange(1, num_tokens, 3)
        routing_map[partly, experts[partly, 0]] = False
    return routing_map


def _permute_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(num_tokens: int, hidden: int, num_experts: int, topk: int, drop: bool = False) -> tuple:
        tokens = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
        return tokens, topk_routing_map(num_tokens, num_experts, topk, gen, drop).to(device)

    top2 = make(16, 32, 8, 2)
    return [
        Case("top-2 8 experts", top2),
        Case("top-1 odd", make(13, 7, 5, 1)),
        Case("dropped and unrouted tokens", make(23, 24, 6, 3, drop=True)),
        Case("one expert", make(9, 16, 1, 1)),
        Case("num_out_tokens", top2, {"num_out_tokens": int(top2[1].sum())}),
    ]


def _unpermute_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(1)

    def make(
        num_tokens: int,
        hidden: int,
        num_experts: int,
        topk: int,
        drop: bool = False,
        probs_dtype: torch.dtype | None = None,
        with_probs: bool = True,
    ) -> tuple:
        tokens = torch.randn(num_tokens, hidden, generator=gen)
        routing_map = topk_routing_map(num_tokens, num_experts, topk, gen, drop)
        permuted, sorted_indices = moe_permute_reference(tokens, routing_map)
        probs = torch.rand(num_tokens, num_experts, generator=gen).to(device, probs_dtype or dtype)
        return (
            permuted.to(device, dtype),
            sorted_indices.to(device),
            torch.Size(tokens.shape),
            probs if with_probs else None,
            routing_map.to(device) if with_probs else None,
        )

    return [
        Case("top-2 probs", make(16, 32, 8, 2)),
        Case("top-1 odd", make(13, 7, 5, 1)),
        Case("dropped and unrouted tokens", make(23, 24, 6, 3, drop=True)),
        Case("fp32 probs", make(12, 20, 4, 2, probs_dtype=torch.float32)),
        Case("no probs", make(11, 12, 4, 2, with_probs=False)),
    ]


def _bench_permute(dtype: torch.dtype, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(4096, 1024, generator=gen).to(device, dtype)
    return Case("T=4096 H=1024 E=8 top-2", (tokens, topk_routing_map(4096, 8, 2, gen).to(device)))


def _bench_unpermute(dtype: torch.dtype, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(0)
    routing_map = topk_routing_map(4096, 8, 2, gen).to(device)
    sorted_indices = sorted_token_indices(routing_map)
    permuted = torch.randn(sorted_indices.numel(), 1024, generator=gen).to(device, dtype)
    probs = torch.rand(4096, 8, generator=gen).to(device, dtype)
    return Case("T=4096 H=1024 E=8 top-2", (permuted, sorted_indices, torch.Size((4096, 1024)), probs, routing_map))


register_op(
    OpSpec(
        name="moe_permute",
        reference=moe_permute_reference,
        doc="group tokens expert-major by a routing map (megatron moe_utils.permute)",
        cases=_permute_cases,
        bench_case=_bench_permute,
    )
)
register_op(
    OpSpec(
        name="moe_unpermute",
        reference=moe_unpermute_reference,
        doc="scatter-add expert outputs back to tokens, weighted by routing probs (megatron unpermute)",
        cases=_unpermute_cases,
        bench_case=_bench_unpermute,
    )
)


# -- "native": memory-lean autograd functions ------------------------------------------------------


class _PermuteFunction(torch.autograd.Function):
    """Row gather that keeps only the index vector for backward (an ``index_add``)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = tokens.shape[0]
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor) -> tuple[torch.Tensor, None]:
        (sorted_indices,) = ctx.saved_tensors
        grad_tokens = grad_rows.new_zeros(ctx.num_tokens, grad_rows.shape[1])
        return grad_tokens.index_add_(0, sorted_indices, grad_rows), None


#: Rows weighted and scattered per step in the native unpermute: bounds its temporary to
#: ``_CHUNK_ROWS x hidden`` instead of a weighted copy of every row.
_CHUNK_ROWS = 1024


class _UnpermuteFunction(torch.autograd.Function):
    """Weighted row scatter-add whose backward is a single gather.

    Saves the index vector, the per-row probabilities, and the rows themselves only when the
    probabilities need a gradient (it is ``<grad_out[token], row>``); never an expanded
    ``[rows, hidden]`` index or the weighted product. The forward weights the rows a chunk at a
    time, and the backward scales the gathered gradient in place and takes the per-row dot
    products with a batched matmul, so no ``[rows, hidden]`` temporary beyond the gradient.
    """

    @staticmethod
    def forward(
        ctx, permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int, row_probs: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.input_dtype = permuted.dtype
        ctx.probs_grad = row_probs is not None and ctx.needs_input_grad[3]
        ctx.save_for_backward(sorted_indices, row_probs, permuted if ctx.probs_grad else None)
        if row_probs is None:
            return permuted.new_zeros(num_tokens, permuted.shape[1]).index_add_(0, sorted_indices, permuted)
        dtype = torch.result_type(permuted, row_probs)  # megatron multiplies in the promoted dtype
        out = torch.zeros(num_tokens, permuted.shape[1], dtype=dtype, device=permuted.device)
        for start in range(0, permuted.shape[0], _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            out.index_add_(0, sorted_indices[rows], permuted[rows] * row_probs[rows].unsqueeze(-1))
        return out.to(permuted.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        sorted_indices, row_probs, permuted = ctx.saved_tensors
        grad_rows = grad_out.index_select(0, sorted_indices)
        if row_probs is None:
            return grad_rows, None, None, None
        grad_rows = grad_rows.to(torch.result_type(grad_rows, row_probs))  # no copy if the same
        grad_probs = None
        if ctx.probs_grad:  # <grad_rows[r], permuted[r]> for every row r
            dots = torch.bmm(grad_rows.unsqueeze(1), permuted.to(grad_rows.dtype).unsqueeze(2))
            grad_probs = dots.view(-1).to(row_probs.dtype)
        grad_permuted = None
        if ctx.needs_input_grad[0]:
            grad_permuted = grad_rows.mul_(row_probs.unsqueeze(-1)).to(ctx.input_dtype)
        return grad_permuted, None, None, grad_probs


@register_kernel("moe_permute", "native", priority=5)
def moe_permute_native(
    tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_permute_reference` through an autograd function that saves only the indices."""
    check_permute_args(tokens, routing_map)
    sorted_indices = sorted_token_indices(routing_map)
    check_num_out_tokens(num_out_tokens, sorted_indices.numel())
    return _PermuteFunction.apply(tokens, sorted_indices), sorted_indices


@register_kernel("moe_unpermute", "native", priority=5)
def moe_unpermute_native(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_unpermute_reference` with an ``index_add`` forward and a gather backward."""
    check_unpermute_args(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    row_probs = None if probs is None else permuted_probs_of(probs, routing_map)
    return _UnpermuteFunction.apply(permuted_tokens, sorted_indices, int(restore_shape[0]), row_probs)
