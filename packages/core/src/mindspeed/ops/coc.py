"""Matmul fused with its tensor-parallel collective: ``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``.

Under tensor + sequence parallelism a column-parallel linear all-gathers its input along the
sequence dim (dim 0, megatron's ``[s, b, h]``) before its GEMM, and a row-parallel linear
reduce-scatters its output along the sequence dim after it (without sequence parallelism it
all-reduces it: ``matmul_all_reduce``). MindSpeed's compute-communication overlap (CoC,
``--use-ascend-coc``) splits the sequence into ``num_chunks`` pieces and overlaps
the collective of one piece with the GEMM of another; its MC2 kernels (``--use-ascend-mc2``)
fuse the pair inside one vendor kernel.

Each op's reference is the unfused pair, in megatron's order (forward: gather, GEMM; backward:
re-gather the input for the weight gradient, input-gradient GEMM, reduce-scatter). The
``chunked`` kernel is the pipeline: collectives are issued with ``async_op=True`` (on NCCL/HCCL
they run on the communication library's own stream, so they overlap the GEMMs queued on the
compute stream; gloo runs them on its own threads) and waited for only when their rows are needed.
Every output row is the same GEMM row as the reference's, so the two agree bit for bit in fp32
wherever the GEMM of a row does not depend on how many rows are multiplied with it.

``group=None`` (or a group of one rank) means no communication: the ops are then a matmul,
chunked or not (the single-process parity cases use this).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.ops.registry import Case, OpSpec, register_kernel, register_op

#: ``fn(weight, total_input_2d, grad_output_2d) -> grad_weight or None``: how a weight gradient is
#: made (megatron's gradient-accumulation fusion adds it into ``main_grad`` and returns a dummy).
GradWeightFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]


def _world(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _grad_weight(fn: GradWeightFn | None, weight: torch.Tensor, total: torch.Tensor, grad: torch.Tensor) -> Any:
    """The weight gradient from the whole (gathered) input and output gradient, as megatron makes it."""
    x2d = total.reshape(-1, total.shape[-1])
    g2d = grad.reshape(-1, grad.shape[-1])
    return g2d.t().matmul(x2d) if fn is None else fn(weight, x2d, g2d)


def _gather(x: torch.Tensor, group: Any, async_op: bool = False) -> tuple[torch.Tensor, Any]:
    """All-gather ``x`` along dim 0 into ``[world * s, ...]``; with ``async_op`` also the work handle."""
    world = _world(group)
    if world == 1:
        return x, None
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    return out, dist.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=async_op)


def _reduce_scatter(x: torch.Tensor, group: Any, async_op: bool = False) -> tuple[torch.Tensor, Any]:
    """Reduce-scatter ``x`` (``[world * s, ...]``) along dim 0 into this rank's ``[s, ...]``."""
    world = _world(group)
    if world == 1:
        return x, None
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    return out, dist.reduce_scatter_tensor(out, x.contiguous(), group=group, async_op=async_op)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, full: bool) -> None:
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"{name}: x's last dim {x.shape[-1]} != weight's in-features {weight.shape[-1]}")
    if num_chunks < 1:
        raise ValueError(f"{name}: num_chunks={num_chunks}; use a value >= 1 (coc_parallel_num)")
    if full and x.shape[0] % _world(group):
        raise ValueError(f"{name}: sequence dim {x.shape[0]} does not split over {_world(group)} ranks")


# -- the three ways of doing each pair (reference, chunked pipeline, a vendor's fused kernel) --


@dataclass(frozen=True)
class CocKernels:
    """How one kernel family multiplies and communicates; the autograd Functions below are shared.

    ``gather_matmul(x, w, group, num_chunks, keep) -> (gather(x) @ w^T, gather(x) or None)``: the
    gathered input comes back when ``keep`` asks for it, or always where the kernel makes it anyway
    (``keeps_gathered``: it is then saved for the weight gradient instead of being re-gathered).
    ``matmul_scatter(x, w, group, num_chunks) -> reduce_scatter(x @ w^T)``.
    ``matmul_all_reduce(x, w, group, num_chunks) -> all_reduce(x @ w^T)``.
    Each op's backward is the other op of its pair: an all-gather-matmul's input gradient is a
    matmul-reduce-scatter of the output gradient, and the other way round.
    """

    gather_matmul: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    matmul_scatter: Callable[..., torch.Tensor]
    matmul_all_reduce: Callable[..., torch.Tensor]
    keeps_gathered: bool = False


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, fn: Any, kernels: Any
    ) -> Any:
        out, total = kernels.gather_matmul(x, weight, group, num_chunks, False)
        ctx.kept = kernels.keeps_gathered and total is not None
        ctx.save_for_backward(total if ctx.kept else x, weight)
        ctx.group, ctx.num_chunks, ctx.grad_weight_fn, ctx.kernels = group, num_chunks, fn, kernels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved, weight = ctx.saved_tensors
        # Unless the kernel kept it, the whole input for the weight gradient is re-gathered (as
        # megatron does: the gathered input is not kept), in flight during the input gradient.
        total, handle = (saved, None) if ctx.kept else _gather(saved, ctx.group, async_op=True)
        grad_input = ctx.kernels.matmul_scatter(grad, weight.t(), ctx.group, ctx.num_chunks)
        if handle is not None:
            handle.wait()
        return grad_input, _grad_weight(ctx.grad_weight_fn, weight, total, grad), None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, fn: Any, kernels: Any
    ) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.num_chunks, ctx.grad_weight_fn, ctx.kernels = group, num_chunks, fn, kernels
        return kernels.matmul_scatter(x, weight, group, num_chunks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        # The gathered output gradient is kept whole for the weight gradient.
        grad_input, total_grad = ctx.kernels.gather_matmul(grad, weight.t(), ctx.group, ctx.num_chunks, True)
        return grad_input, _grad_weight(ctx.grad_weight_fn, weight, x, total_grad), None, None, None, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, fn: Any, kernels: Any
    ) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.grad_weight_fn = fn
        return kernels.matmul_all_reduce(x, weight, group, num_chunks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # The all-reduce's backward is the identity (megatron's reduce_from_tensor_model_parallel_region).
        x, weight = ctx.saved_tensors
        return grad.matmul(weight), _grad_weight(ctx.grad_weight_fn, weight, x, grad), None, None, None, None


def run_coc(
    op: str, kernels: CocKernels, x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, fn: Any
) -> Any:
    """Check the operands of ``op`` and run it with ``kernels`` (the registered kernels' common body)."""
    _check(op, x, weight, group, num_chunks, full=op == "matmul_reduce_scatter")
    function = {"all_gather_matmul": _AllGatherMatmul, "matmul_reduce_scatter": _MatmulReduceScatter}.get(
        op, _MatmulAllReduce
    )
    return function.apply(x, weight, group, num_chunks, fn, kernels)


# -- the references: the unfused pair ---------------------------------------------------------


def _ref_gather_matmul(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int, keep: bool) -> Any:
    total, _ = _gather(x, group)
    return torch.matmul(total, w.t()), total if keep else None


def _ref_matmul_scatter(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    return _reduce_scatter(torch.matmul(x, w.t()), group)[0]


def _ref_matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    out = torch.matmul(x, w.t())
    if _world(group) > 1:
        dist.all_reduce(out, group=group)
    return out


REFERENCE = CocKernels(_ref_gather_matmul, _ref_matmul_scatter, _ref_matmul_all_reduce)


def all_gather_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """All-gather ``x`` along the sequence dim over ``group``, then ``total @ weight^T``.

    Args:
        x: this rank's sequence shard ``[s, ..., in]``.
        weight: ``[out, in]`` (this rank's column shard).
        group: the tensor-parallel group (``None``: one rank, no communication).
        num_chunks: pipeline depth of the chunked kernels (the reference does not chunk).
        grad_weight_fn: how the weight gradient is made (``None``: ``grad^T @ total_input``).

    Returns:
        ``[world * s, ..., out]``.
    """
    return run_coc("all_gather_matmul", REFERENCE, x, weight, group, num_chunks, grad_weight_fn)


def matmul_reduce_scatter_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """``x @ weight^T``, then reduce-scatter (sum) along the sequence dim over ``group``.

    Args:
        x: the whole sequence ``[world * s, ..., in]`` (this rank's row shard of the features).
        weight: ``[out, in]``.
        group, num_chunks, grad_weight_fn: as in :func:`all_gather_matmul_reference`.

    Returns:
        this rank's summed sequence shard ``[s, ..., out]``.
    """
    return run_coc("matmul_reduce_scatter", REFERENCE, x, weight, group, num_chunks, grad_weight_fn)


def matmul_all_reduce_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """``x @ weight^T``, then all-reduce (sum) over ``group``: a row-parallel linear without
    sequence parallelism.

    Args:
        x: ``[s, ..., in]`` (this rank's row shard of the features).
        weight, group, num_chunks, grad_weight_fn: as in :func:`all_gather_matmul_reference`.

    Returns:
        ``[s, ..., out]``, the same on every rank.
    """
    return run_coc("matmul_all_reduce", REFERENCE, x, weight, group, num_chunks, grad_weight_fn)


# -- the chunked pipelines ---------------------------------------------------------------------


def _chunks(rows: int, num_chunks: int) -> list[slice]:
    """``min(num_chunks, rows)`` consecutive row ranges covering ``rows`` (sizes differ by at most one)."""
    bounds = torch.linspace(0, rows, min(num_chunks, max(rows, 1)) + 1).round().long().tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _gathered_matmul(
    x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int, keep: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gather(x) @ weight^T`` in pipelined chunks; with ``keep`` also ``gather(x)`` itself.

    The gather of chunk ``i + 1`` is in flight while chunk ``i`` is multiplied. Row ``r * s + j``
    of the result is rank ``r``'s row ``j`` times ``weight^T``, as in the unchunked product.
    """
    world, rows = _world(group), x.shape[0]
    pieces = _chunks(rows, num_chunks)
    out = x.new_empty((world, rows, *x.shape[1:-1], weight.shape[0]))
    total = x.new_empty((world, rows, *x.shape[1:])) if keep else None
    pending = [_gather(x[pieces[0]], group, async_op=True)]
    for i, piece in enumerate(pieces):
        if i + 1 < len(pieces):
            pending.append(_gather(x[pieces[i + 1]], group, async_op=True))
        gathered, handle = pending[i]
        if handle is not None:
            handle.wait()
        gathered = gathered.view(world, piece.stop - piece.start, *x.shape[1:])
        out[:, piece] = torch.matmul(gathered, weight.t())
        if total is not None:
            total[:, piece] = gathered
    whole = None if total is None else total.view(world * rows, *x.shape[1:])
    return out.view(world * rows, *out.shape[2:]), whole


def _matmul_scattered(x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    """``reduce_scatter(x @ weight^T)`` in pipelined chunks: chunk ``i``'s reduce-scatter runs
    while chunk ``i + 1`` is multiplied."""
    world = _world(group)
    rows = x.shape[0] // world
    xv = x.view(world, rows, *x.shape[1:])
    pending = []
    for piece in _chunks(rows, num_chunks):
        product = torch.matmul(xv[:, piece], weight.t())
        pending.append(_reduce_scatter(product.view(-1, *product.shape[2:]), group, async_op=True))
    for _, handle in pending:
        if handle is not None:
            handle.wait()
    return torch.cat([part for part, _ in pending])


def _matmul_all_reduced(x: torch.Tensor, weight: torch.Tensor, group: Any, num_chunks: int) -> torch.Tensor:
    """``all_reduce(x @ weight^T)`` in pipelined chunks: chunk ``i``'s all-reduce runs while chunk
    ``i + 1`` is multiplied."""
    pending = []
    for piece in _chunks(x.shape[0], num_chunks):
        product = torch.matmul(x[piece], weight.t())
        handle = dist.all_reduce(product, group=group, async_op=True) if _world(group) > 1 else None
        pending.append((product, handle))
    for _, handle in pending:
        if handle is not None:
            handle.wait()
    return torch.cat([part for part, _ in pending])


CHUNKED = CocKernels(_gathered_matmul, _matmul_scattered, _matmul_all_reduced)


def all_gather_matmul_chunked(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """:func:`all_gather_matmul_reference` as a pipeline of ``num_chunks`` sequence chunks.

    Forward: the gather of chunk ``i + 1`` overlaps the GEMM of chunk ``i``. Backward: the
    input-gradient GEMM of chunk ``i + 1`` overlaps the reduce-scatter of chunk ``i``, and the
    re-gather of the whole input (for the weight gradient) overlaps both.
    """
    return run_coc("all_gather_matmul", CHUNKED, x, weight, group, num_chunks, grad_weight_fn)


def matmul_reduce_scatter_chunked(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """:func:`matmul_reduce_scatter_reference` as a pipeline of ``num_chunks`` sequence chunks.

    Forward: the reduce-scatter of chunk ``i`` overlaps the GEMM of chunk ``i + 1``. Backward:
    the gather of the output gradient's chunk ``i + 1`` overlaps the GEMM of chunk ``i``.
    """
    return run_coc("matmul_reduce_scatter", CHUNKED, x, weight, group, num_chunks, grad_weight_fn)


def matmul_all_reduce_chunked(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Any = None,
    num_chunks: int = 1,
    grad_weight_fn: GradWeightFn | None = None,
) -> torch.Tensor:
    """:func:`matmul_all_reduce_reference` as a pipeline: the all-reduce of chunk ``i`` overlaps
    the GEMM of chunk ``i + 1`` (the backward has no communication)."""
    return run_coc("matmul_all_reduce", CHUNKED, x, weight, group, num_chunks, grad_weight_fn)


def _cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    def make(s: int, b: int, n_in: int, n_out: int, chunks: int, name: str) -> Case:
        x = torch.randn(s, b, n_in, dtype=dtype, device=device)
        w = torch.randn(n_out, n_in, dtype=dtype, device=device) / n_in**0.5
        return Case(name, (x, w), {"num_chunks": chunks})

    return [
        make(8, 2, 16, 24, 2, "even chunks"),
        make(7, 3, 33, 5, 3, "odd shape, uneven chunks"),
        make(3, 1, 8, 8, 4, "more chunks than rows"),
    ]


def _bench(dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(512, 2, 1024, dtype=dtype, device=device)
    w = torch.randn(1024, 1024, dtype=dtype, device=device) / 32
    return Case("seq 512 x 2, 1024 -> 1024, 4 chunks (one rank)", (x, w), {"num_chunks": 4})


register_op(
    OpSpec(
        name="all_gather_matmul",
        reference=all_gather_matmul_reference,
        doc="all-gather along the sequence dim over the TP group, then x @ W^T (CoC / MC2 slot)",
        cases=_cases,
        bench_case=_bench,
    )
)
register_op(
    OpSpec(
        name="matmul_reduce_scatter",
        reference=matmul_reduce_scatter_reference,
        doc="x @ W^T, then reduce-scatter along the sequence dim over the TP group (CoC / MC2 slot)",
        cases=_cases,
        bench_case=_bench,
    )
)
register_op(
    OpSpec(
        name="matmul_all_reduce",
        reference=matmul_all_reduce_reference,
        doc="x @ W^T, then all-reduce over the TP group (CoC / MC2 slot, TP without sequence parallelism)",
        cases=_cases,
        bench_case=_bench,
    )
)
register_kernel("all_gather_matmul", "chunked", priority=10)(all_gather_matmul_chunked)
register_kernel("matmul_all_reduce", "chunked", priority=10)(matmul_all_reduce_chunked)
register_kernel("matmul_reduce_scatter", "chunked", priority=10)(matmul_reduce_scatter_chunked)


# -- MC2's matmul + all-reduce + residual add + rms_norm ----------------------------------------


def _check_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor) -> None:
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"mm_all_reduce_add_rms_norm: x's last dim {x.shape[-1]} != weight's in-features {weight.shape[-1]}"
        )
    want = (*x.shape[:-1], weight.shape[0])
    if tuple(residual.shape) != want:
        raise ValueError(
            f"mm_all_reduce_add_rms_norm: residual {list(residual.shape)} must have the product's shape {list(want)}"
        )
    if tuple(gamma.shape) != (weight.shape[0],):
        raise ValueError(f"mm_all_reduce_add_rms_norm: gamma {list(gamma.shape)} must be [{weight.shape[0]}]")


def mm_all_reduce_add_rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    group: Any = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-parallel linear's output added to the residual stream and normalised, unfused:
    ``y = residual + all_reduce(x @ weight^T) (+ bias)``, ``rms_norm(y, gamma, eps)``.

    MindSpeed's MC2 op ``npu_mm_all_reduce_add_rms_norm`` does the four in one vendor kernel (the
    end of one transformer block and the start of the next: attention projection or fc2, the
    TP all-reduce, the residual connection, the next pre-norm). Here each step is the registry's:
    ``matmul_all_reduce``'s reference (its backward: the all-reduce's is the identity, as
    megatron's), the add, and ``rms_norm``'s reference.

    Args:
        x: ``[..., in]``, this rank's shard of the features (row-parallel input).
        weight: ``[hidden, in]`` (megatron's ``[out, in]``).
        residual: ``[..., hidden]``, the residual stream (the same on every rank).
        gamma: ``[hidden]`` rms_norm weight.
        group: the tensor-parallel group (``None``: one rank, no communication).
        eps: rms_norm's epsilon.
        bias: ``[hidden]`` linear bias, added once after the all-reduce, or ``None``.

    Returns:
        ``(y, normed)``: the new residual stream ``y`` and ``rms_norm(y)``, both ``[..., hidden]``.
    """
    from mindspeed.ops.norms import rms_norm_reference

    _check_add_rms_norm(x, weight, residual, gamma)
    y = residual + matmul_all_reduce_reference(x, weight, group)
    if bias is not None:
        y = y + bias
    return y, rms_norm_reference(y, gamma, eps)


def _add_rms_norm_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def make(s: int, b: int, n_in: int, hidden: int, bias: bool, name: str) -> Case:
        x = torch.randn(s, b, n_in, generator=gen).to(device, dtype)
        w = (torch.randn(hidden, n_in, generator=gen) / n_in**0.5).to(device, dtype)
        residual = torch.randn(s, b, hidden, generator=gen).to(device, dtype)
        gamma = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
        extra = {"eps": 1e-5, "bias": (0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)} if bias else {}
        return Case(name, (x, w, residual, gamma), extra)

    return [make(8, 2, 16, 24, False, "no bias"), make(7, 3, 33, 40, True, "odd shape, bias, eps 1e-5")]


def _add_rms_norm_bench(dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn(512, 2, 1024, dtype=dtype, device=device)
    w = torch.randn(1024, 1024, dtype=dtype, device=device) / 32
    residual = torch.randn(512, 2, 1024, dtype=dtype, device=device)
    gamma = torch.ones(1024, dtype=dtype, device=device)
    return Case("seq 512 x 2, 1024 -> 1024 (one rank)", (x, w, residual, gamma))


register_op(
    OpSpec(
        name="mm_all_reduce_add_rms_norm",
        reference=mm_all_reduce_add_rms_norm_reference,
        doc="x @ W^T, all-reduce over the TP group, + residual (+ bias), rms_norm: (y, normed) (MC2 slot)",
        cases=_add_rms_norm_cases,
        bench_case=_add_rms_norm_bench,
    )
)
