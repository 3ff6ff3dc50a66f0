"""One entry for every context-parallel algorithm.

:func:`context_parallel_attention` takes this rank's shards of ``q, k, v`` in BSND layout
(``[batch, s_local, heads, dim]``; megatron's ``[s, b, n, d]`` activations are
``x.transpose(0, 1)``) and returns this rank's rows of attention over the whole sequence.
The shards must follow the algorithm's layout
(:func:`~mindspeed.parallel.context_parallel.layout.split_for_context_parallel`).
:class:`ContextParallelAttention` does the same with its config, groups and kernels fixed at
build time (what a model's attention module holds).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed.ops import resolve_kernel
from mindspeed.ops.attention import FEATURE_ALIBI, FEATURE_ALIBI_OFFSET, FEATURE_LSE, FEATURE_VARLEN, FEATURE_WINDOW
from mindspeed.parallel.context_parallel.adaptive import LOCAL, choose_cp_algo
from mindspeed.parallel.context_parallel.blocks import local_cu_seqlens
from mindspeed.parallel.context_parallel.config import ContextParallelConfig
from mindspeed.parallel.context_parallel.double_ring import double_ring_attention
from mindspeed.parallel.context_parallel.groups import ContextParallelGroups
from mindspeed.parallel.context_parallel.hybrid import hybrid_attention
from mindspeed.parallel.context_parallel.kv_allgather import kv_allgather_attention
from mindspeed.parallel.context_parallel.layout import (
    ADAPTIVE,
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    check_algo,
    check_cu_seqlens,
    shard_lengths,
    zigzag_ranges,
)
from mindspeed.parallel.context_parallel.ring import ring_attention
from mindspeed.parallel.context_parallel.ulysses import ulysses_attention


@functools.lru_cache(maxsize=64)
def _kernel(op: str, impl: str, features: tuple[str, ...], device: str):
    """``resolve_kernel`` once per (op, impl, features, accelerator): calls per layer stay cheap."""
    return resolve_kernel(op, impl, device=device, features=features)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"context-parallel attention expects 4-D BSND q, k, v; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree on batch, local sequence and head dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")


def _resolve_groups(
    algo: str,
    cp_group: dist.ProcessGroup,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int, int]:
    """``(ulysses_group, ring_group, cp_rank, ulysses_degree)`` for ``algo``, checked."""
    if algo == ULYSSES:
        group = cp_group if ulysses_group is None else ulysses_group
        return group, None, dist.get_rank(cp_group), dist.get_world_size(group)
    if algo in (RING, ADAPTIVE):
        return None, cp_group if ring_group is None else ring_group, dist.get_rank(cp_group), 1
    if algo == KVALLGATHER:
        return None, None, dist.get_rank(cp_group), 1
    if ulysses_group is None or ring_group is None:
        raise ValueError(
            "hybrid_cp_algo needs ulysses_group and ring_group; build them with build_context_parallel_groups"
        )
    degree, ring_size = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if degree * ring_size != cp_size:
        raise ValueError(f"Ulysses degree {degree} x ring degree {ring_size} must equal the CP degree {cp_size}")
    layout_rank = dist.get_rank(ring_group) * degree + dist.get_rank(ulysses_group)
    if layout_rank != cp_rank:
        raise ValueError(
            f"CP rank {cp_rank} is ring rank {dist.get_rank(ring_group)} and Ulysses rank "
            f"{dist.get_rank(ulysses_group)}, so the data split would not match the attention's layout; "
            "Ulysses groups must be consecutive CP ranks (use build_context_parallel_groups)"
        )
    return ulysses_group, ring_group, cp_rank, degree


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    algo: str,
    cp_group: dist.ProcessGroup,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seq_len: int | None = None,
    impl: str = "auto",
    overlap: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    inner_ring_group: dist.ProcessGroup | None = None,
    outer_ring_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Attention over a sequence sharded across a context-parallel group.

    Args:
        q: ``[batch, s_local, heads_q, dim]``, this rank's shard in ``algo``'s layout.
        k: ``[batch, s_local, heads_kv, dim]``, ``heads_q % heads_kv == 0``.
        v: same shape as ``k``.
        algo: ``ulysses_cp_algo``, ``megatron_cp_algo`` (ring), ``hybrid_cp_algo``,
            ``kvallgather_cp_algo`` (KV all-gather) or ``adaptive_cp_algo`` (one of ring, KV
            all-gather or no communication, chosen from the mask by
            :func:`~mindspeed.parallel.context_parallel.adaptive.choose_cp_algo`).
        cp_group: the CP group; its rank is the CP rank the data was split with.
        ulysses_group: for ``hybrid_cp_algo`` (required); Ulysses uses ``cp_group`` by default.
        ring_group: for ``hybrid_cp_algo`` (required); ring uses ``cp_group`` by default.
        causal: causal mask by global position.
        softmax_scale: score scale (default ``1 / sqrt(dim)``).
        cu_seqlens: GLOBAL boundaries of packed sequences in the unsplit row (the same tensor on
            every rank, ``batch == 1``); attention stays inside each sequence.
        seq_len: length of the unsplit sequence. Default: ``cu_seqlens[-1]`` when packed, else
            ``s_local * C``; pass it when the length is not divisible (uneven shards).
        impl: the ``attention`` kernel (``"auto"`` picks the best one with the features needed).
        overlap: overlap ring transfers with compute.
        window_size: ``(left, right)`` sliding window by global position (``kvallgather_cp_algo``
            and ``adaptive_cp_algo`` only, causal; a Mistral window of ``W`` tokens is ``(W - 1, 0)``).
        alibi_slopes: ``[heads_q]`` ALiBi slopes: ``megatron_cp_algo`` (ring and double ring, causal or
            full mask: each block biased by its global positions), ``kvallgather_cp_algo`` (causal)
            and ``adaptive_cp_algo``.
        inner_ring_group: with ``outer_ring_group``, makes the ring a double ring (``cp_window_size > 1``;
            ``build_context_parallel_groups`` builds both): the window of consecutive CP ranks.
        outer_ring_group: the CP ranks with this rank's inner rank (stride ``cp_window_size``).

    Returns:
        ``[batch, s_local, heads_q, dim]``: this rank's rows of the output.

    Raises:
        ValueError: on an unknown algorithm, missing groups, heads that Ulysses cannot split,
            or shards that do not match the layout.
    """
    check_algo(algo)
    _check_qkv(q, k, v)
    if tuple(window_size) != (-1, -1) and algo not in (KVALLGATHER, ADAPTIVE):
        raise ValueError(f"window_size needs context_parallel_algo {KVALLGATHER} or {ADAPTIVE}, not {algo}")
    if alibi_slopes is not None and algo not in (RING, KVALLGATHER, ADAPTIVE):
        raise ValueError(f"alibi_slopes need context_parallel_algo {RING}, {KVALLGATHER} or {ADAPTIVE}, not {algo}")
    if (inner_ring_group is None) != (outer_ring_group is None) or (
        inner_ring_group is not None and algo not in (RING, ADAPTIVE)
    ):
        raise ValueError(
            "the double ring needs both inner_ring_group and outer_ring_group, with megatron_cp_algo or "
            "adaptive_cp_algo; build them with build_context_parallel_groups(..., cp_window_size=w)"
        )
    ulysses_group, ring_group, cp_rank, degree = _resolve_groups(algo, cp_group, ulysses_group, ring_group)
    cp_size = dist.get_world_size(cp_group)
    if inner_ring_group is not None:
        width, windows = dist.get_world_size(inner_ring_group), dist.get_world_size(outer_ring_group)
        position = dist.get_rank(outer_ring_group) * width + dist.get_rank(inner_ring_group)
        if width < 2 or windows < 2 or width * windows != cp_size or position != cp_rank:
            raise ValueError(
                f"the double ring's groups ({windows} windows of {width}; this rank at {position}) do not match "
                f"CP rank {cp_rank} of {cp_size}; build them with build_context_parallel_groups(..., cp_window_size=w)"
            )
    bounds = None
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch == 1; got batch {q.shape[0]}")
        bounds = check_cu_seqlens(cu_seqlens.tolist(), seq_len if seq_len is not None else int(cu_seqlens[-1]))
        seq_len = bounds[-1]
    if seq_len is None:
        seq_len = q.shape[1] * cp_size
    lengths = shard_lengths(seq_len, cp_size, algo, degree)
    if min(lengths) == 0:
        raise ValueError(
            f"a {seq_len}-token sequence leaves some of the {cp_size} CP ranks without tokens under {algo} "
            f"(shard lengths {lengths}); use a smaller context_parallel_size for such short sequences"
        )
    expected = lengths[cp_rank]
    if q.shape[1] != expected:
        raise ValueError(
            f"CP rank {cp_rank} holds {q.shape[1]} positions, but {algo} over {cp_size} ranks of a {seq_len}-token "
            f"sequence gives it {expected}; split with split_for_context_parallel and pass seq_len when unaligned"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    device = get_accelerator().name  # what resolve_kernel picks for; only the cache key here
    varlen = (FEATURE_VARLEN,) if bounds is not None else ()
    if algo == ADAPTIVE:
        algo = choose_cp_algo(seq_len, cp_size, causal, bounds, tuple(window_size), alibi_slopes is not None).algo
        if algo == LOCAL:
            # No block off the diagonal: the shard's own keys are all it attends (nothing moves).
            ranges = zigzag_ranges(seq_len, cp_rank, cp_size)
            cu = local_cu_seqlens(ranges, bounds)
            cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
            # Each visible pair lies inside one chunk (and one packed segment), whose positions are
            # consecutive: ALiBi's local distances are the global ones.
            alibi = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
            attend = _kernel("attention", impl, ((FEATURE_ALIBI,) if alibi else ()) + varlen, device)
            return attend(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu, **alibi)
    if algo == KVALLGATHER:
        masks = ((FEATURE_WINDOW,) if tuple(window_size) != (-1, -1) else ()) + (
            (FEATURE_ALIBI,) if alibi_slopes is not None else ()
        )
        return kv_allgather_attention(
            q,
            k,
            v,
            group=cp_group,
            seq_len=seq_len,
            causal=causal,
            softmax_scale=scale,
            bounds=bounds,
            attend=_kernel("attention", impl, (*masks, *varlen), device),
            window_size=window_size,
            alibi_slopes=alibi_slopes,
        )
    if algo == ULYSSES:
        attend = _kernel("attention", impl, varlen, device)
        return ulysses_attention(
            q,
            k,
            v,
            group=ulysses_group,
            seq_len=seq_len,
            causal=causal,
            softmax_scale=scale,
            cu_seqlens=cu_seqlens,
            attend=attend,
        )
    alibi = (FEATURE_ALIBI, FEATURE_ALIBI_OFFSET) if alibi_slopes is not None else ()
    attend = _kernel("attention", impl, (FEATURE_LSE, *alibi, *varlen), device)
    update = _kernel("ring_attention_update", "auto", (), device)
    common = dict(seq_len=seq_len, causal=causal, softmax_scale=scale, bounds=bounds, attend=attend, update=update)
    if algo == RING and inner_ring_group is not None:
        return double_ring_attention(
            q,
            k,
            v,
            inner_group=inner_ring_group,
            outer_group=outer_ring_group,
            overlap=overlap,
            alibi_slopes=alibi_slopes,
            **common,
        )
    if algo == RING:
        return ring_attention(q, k, v, group=ring_group, overlap=overlap, alibi_slopes=alibi_slopes, **common)
    assert algo == HYBRID
    return hybrid_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, overlap=overlap, **common)


class ContextParallelAttention:
    """Context-parallel attention with its config and groups fixed (what an attention module holds).

    Args:
        config: the CP config.
        groups: this rank's CP groups (``build_context_parallel_groups``).

    Example::

        groups = build_context_parallel_groups(
            cp_group, config.context_parallel_algo, config.ulysses_degree_in_cp
        )
        attn = ContextParallelAttention(config, groups)
        out = attn(q, k, v, causal=True)            # BSND local shards in, local shard out
    """

    def __init__(self, config: ContextParallelConfig, groups: ContextParallelGroups) -> None:
        if groups.cp_size != config.context_parallel_size:
            raise ValueError(
                f"the CP group has {groups.cp_size} ranks but context_parallel_size is {config.context_parallel_size}"
            )
        if (config.cp_window_size > 1) != (groups.inner_ring_group is not None):
            raise ValueError(
                f"cp_window_size={config.cp_window_size} but the groups were built "
                f"{'with' if groups.inner_ring_group is not None else 'without'} a double ring's window; "
                "pass the same cp_window_size to build_context_parallel_groups"
            )
        self.config, self.groups = config, groups
        # Resolve (and log) the kernel now, so that a kernel that cannot serve the algorithm
        # (ring needs lse) fails at build time; calls reuse the same cached resolution.
        needs_lse = config.context_parallel_algo in (RING, HYBRID, ADAPTIVE)
        features = (FEATURE_LSE,) if needs_lse else ()
        self.kernel = _kernel("attention", config.attention_impl, features, get_accelerator().name)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """Same as :func:`context_parallel_attention` with this object's config and groups."""
        return context_parallel_attention(
            q,
            k,
            v,
            algo=self.config.context_parallel_algo,
            cp_group=self.groups.cp_group,
            ulysses_group=self.groups.ulysses_group,
            ring_group=self.groups.ring_group,
            causal=causal,
            softmax_scale=softmax_scale,
            cu_seqlens=cu_seqlens,
            seq_len=seq_len,
            impl=self.config.attention_impl,
            overlap=self.config.use_cp_send_recv_overlap,
            inner_ring_group=self.groups.inner_ring_group,
            outer_ring_group=self.groups.outer_ring_group,
        )
