"""megatron-core modules made of registry kernels, plugged in through module specs.

Each module keeps megatron's constructor and forward signature, so a ``ModuleSpec`` can name
it in place of megatron's own; the kernel is resolved once at construction (``impl``:
"auto", "reference" or a backend name).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from torch import nn

from mindspeed.device import get_accelerator
from mindspeed.megatron.compiled_attention import config_key, eager_attention, register_call
from mindspeed.megatron.compiled_packing import CompiledPackedParams, packed_attention, packed_attention_saved
from mindspeed.megatron.shared_prefix import SharedPrefixParams, attend_shared_prefix
from mindspeed.ops import resolve_kernel
from mindspeed.ops.alibi import shard_alibi_slopes
from mindspeed.ops.attention import FEATURE_ALIBI, FEATURE_ALIBI_OFFSET, FEATURE_LSE, FEATURE_VARLEN
from mindspeed.parallel.context_parallel import (
    ADAPTIVE,
    HYBRID,
    KVALLGATHER,
    RING,
    ULYSSES,
    ContextParallelGroups,
    build_context_parallel_groups,
    context_parallel_attention,
    shard_ranges,
)
from mindspeed.parallel.context_parallel.adaptive import LOCAL, choose_cp_algo
from mindspeed.parallel.context_parallel.api import _kernel
from mindspeed.parallel.context_parallel.blocks import local_cu_seqlens
from mindspeed.parallel.context_parallel.double_ring import double_ring_attention
from mindspeed.parallel.context_parallel.kv_allgather import kv_allgather_attention
from mindspeed.parallel.context_parallel.layout import packed_shard_ranges
from mindspeed.parallel.context_parallel.ring import ring_attention
from mindspeed.parallel.context_parallel.ulysses import ulysses_attention

#: megatron-core's ``cp_comm_type`` (the per-layer CP setting it hands to core attention) ->
#: MindSpeed's ``context_parallel_algo``. ``None`` is megatron's default, the ring ("p2p").
CP_COMM_TYPES = {None: RING, "p2p": RING, "a2a": ULYSSES, "a2a+p2p": HYBRID, "all_gather": KVALLGATHER}
#: The reverse, for the ``context_parallel`` feature.
CP_ALGO_COMM_TYPES = {RING: "p2p", ULYSSES: "a2a", HYBRID: "a2a+p2p", KVALLGATHER: "all_gather", ADAPTIVE: "p2p"}


class RegistryNorm(nn.Module):
    """RMSNorm or LayerNorm (from ``config.normalization``) on the registry's kernel.

    Under sequence parallelism each rank normalises its own tokens; the weights are tagged
    ``sequence_parallel`` so megatron's ``finalize_model_grads`` all-reduces their gradients
    over the tensor-parallel group.
    """

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        impl: str = "auto",
        zero_centered: bool | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"normalization {config.normalization!r} is not supported by RegistryNorm; use RMSNorm or LayerNorm"
            )
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        # Zero-centred gamma (megatron's --apply-layernorm-1p, Gemma's RMSNorm): the weight is
        # stored as w and the norm scales by 1 + w. ``zero_centered`` overrides the config for one
        # norm (Qwen3-Next's gated output norm keeps a plain weight in a (1 + w) model).
        self.zero_centered = bool(config.layernorm_zero_centered_gamma if zero_centered is None else zero_centered)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
        self.kernel = resolve_kernel("rms_norm" if self.rms else "layer_norm", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 1 + w in fp32 (as transformers' Gemma RMSNorm): a half-precision 1 + w would round w away.
        weight = self.weight.float() + 1 if self.zero_centered else self.weight
        if self.rms:
            return self.kernel(x, weight, self.eps)
        return self.kernel(x, weight, self.bias, self.eps)


class RegistrySwiGLU(nn.Module):
    """The gated activation of megatron's MLP (``use_te_activation_func=True`` routes to it)."""

    def __init__(self, config: Any, impl: str = "auto", **_: Any) -> None:
        super().__init__()
        if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
            raise ValueError("RegistrySwiGLU needs gated_linear_unit=True and activation_func=F.silu")
        self.kernel = resolve_kernel("swiglu", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No parameters, nothing to checkpoint (megatron's MLP asks every submodule)."""
        return {}


class RegistryAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` on the registry's attention kernel.

    Takes megatron's ``[s, b, heads, dim]`` layout, supports causal and unmasked attention,
    GQA, ``config.window_size`` (on the layers ``config.window_attn_skip_freq`` picks) and
    ``config.softmax_scale``. With
    ``config.context_parallel_size > 1`` it runs :mod:`mindspeed.parallel.context_parallel` over
    the CP group of ``pg_collection``, the algorithm chosen by megatron's own ``cp_comm_type``
    (:data:`CP_COMM_TYPES`; hybrid's Ulysses degree is
    ``config.hierarchical_context_parallel_sizes[0]``). Packed sequences (``qkv_format='thd'``)
    attend within their ``cu_seqlens`` segments; under context parallelism every segment is
    split zig-zag on its own (megatron's THD layout, ``cu_seqlens`` global, each length a
    multiple of ``2 * C``).

    With ``alibi=True`` (the spec of an ALiBi model) the scores get ALiBi's bias; this rank's
    slopes are those of its tensor-parallel heads (megatron gives rank ``r`` of ``T`` the heads
    ``r * n / T .. (r + 1) * n / T - 1``). Under context parallelism with the ring or double ring
    (``'p2p'``: every block biased by its global positions), Ulysses (``'a2a'``, unpacked), KV
    all-gather (``cp_comm_type='all_gather'``, which also takes ``window_size``) or adaptive CP;
    not with hybrid nor shared-prefix packing.

    ``config.softmax_type='learnable'`` (GPT-OSS's attention sinks) gives it megatron's
    ``softmax_offset`` parameter, one logit per local head, passed to the kernel as ``sinks``
    (megatron's own ``DotProductAttention`` allocates it on a CUDA device, so it cannot run
    elsewhere); not under context parallelism.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        impl: str = "auto",
        alibi: bool = False,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout={dropout} is not supported by the registry attention kernels; "
                "set attention_dropout=0.0 (usual for LLMs) or use megatron's DotProductAttention"
            )
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        window = getattr(config, "window_size", None)
        if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
            window = None  # a full-attention layer among sliding-window ones (megatron's rule)
        self.window_size = tuple(window) if window is not None else (-1, -1)
        features = ("window",) if window is not None else ()
        self.impl = impl
        self.cp: _ContextParallel | None = None
        if config.context_parallel_size > 1:
            self.cp = _ContextParallel(config, cp_comm_type, pg_collection)
            if window is not None and self.cp.algo != KVALLGATHER and not self.cp.adaptive:
                raise ValueError(
                    f"window_size under context parallelism needs cp_comm_type 'all_gather' (kvallgather_cp_algo), "
                    f"not {self.cp.algo}; unset it, use all_gather, adaptive_cp_algo or context_parallel_size=1"
                )
            if self.cp.algo in (RING, HYBRID) and not (self.cp.adaptive and window is not None):
                # Ring and hybrid merge blocks by their lse: fail at build time if the kernel has none.
                # (Adaptive CP runs a window layer by the KV all-gather, which needs none.)
                features = (FEATURE_LSE,)
        self.alibi_slopes = _alibi_slopes(config, pg_collection) if alibi else None
        if alibi:
            features = (*features, FEATURE_ALIBI)
            if self.cp is not None and self.cp.algo == HYBRID:
                raise ValueError(
                    "ALiBi under context parallelism needs the ring, Ulysses or KV all-gather (cp_comm_type "
                    "'p2p', 'a2a' or 'all_gather'), not hybrid 'a2a+p2p'"
                )
            if self.cp is not None and self.cp.algo == RING and FEATURE_LSE in features:
                features = (*features, FEATURE_ALIBI_OFFSET)  # each ring block is biased by its global positions
        self.features = features
        self.kernel = resolve_kernel("attention", impl, features=features)
        self.softmax_offset = self._make_sinks(config, pg_collection)
        self._cp_calls = self._register_cp_calls() if self.cp is not None else {}

    def _make_sinks(self, config: Any, pg_collection: Any) -> nn.Parameter | None:
        kind = getattr(config, "softmax_type", "vanilla")
        if kind == "vanilla":
            return None
        if kind != "learnable":
            raise ValueError(
                f"softmax_type {kind!r} is not supported by RegistryAttention; use 'vanilla' or 'learnable'"
            )
        if self.cp is not None:
            raise ValueError("attention sinks (softmax_type='learnable') are not supported under context parallelism")
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        sinks = nn.Parameter(torch.zeros(config.num_attention_heads // tp, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(sinks.data)
        set_tensor_model_parallel_attributes(sinks, is_parallel=True, dim=0, stride=1)
        return sinks

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The sinks, cut by heads over the tensor-parallel group (as megatron's ``DotProductAttention``)."""
        if self.softmax_offset is None:
            return {}
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset},
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=getattr(self, "tp_group", None),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by RegistryAttention")
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if not causal and mask_type != AttnMaskType.no_mask and attention_mask is not None:
            raise ValueError(
                f"attention mask type {mask_type} with an explicit mask is not supported; use causal or no_mask"
            )
        if packed_seq_params is not None:
            return self._attend_packed(query, key, value, packed_seq_params, causal)
        if self.cp is not None:
            if not causal and attention_mask is not None:
                raise ValueError("an explicit attention mask is not supported under context parallelism")
            if torch.compiler.is_compiling():
                # A compiled layer: the eager algorithm as one opaque op (mindspeed.megatron.compiled_attention).
                return eager_attention(query, key, value, self._cp_calls[causal])
            return self._attend_cp(query, key, value, causal)
        # [s, b, n, d] -> [b, s, n, d] for the kernel, and back to megatron's [s, b, n * d].
        out = self.kernel(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            causal=causal,
            softmax_scale=self.softmax_scale,
            window_size=self.window_size,
            **self._sinks(),
            **self._alibi_kwargs(query.device),
        )
        sq, b = query.shape[0], query.shape[1]
        return out.transpose(0, 1).reshape(sq, b, -1)

    def _attend_cp(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> torch.Tensor:
        """Context-parallel attention of megatron's ``[s, b, n, d]`` shards: ``[s, b, n * d]``."""
        out = self.cp.attend(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            causal=causal,
            softmax_scale=self.softmax_scale,
            kernel=self.kernel,
            impl=self.impl,
            window_size=self.window_size,
            **self._alibi_kwargs(query.device, self.cp.ulysses_group),
        )
        return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _register_cp_calls(self) -> dict[bool, int]:
        """:meth:`_attend_cp` (causal and not) as indices for the compiled layers' opaque op; layers
        configured alike share them (and so one graph)."""
        calls = {}
        for causal in (True, False):
            key = config_key(
                self.cp, causal, self.softmax_scale, self.kernel, self.impl, self.window_size, self.alibi_slopes
            )
            calls[causal] = register_call(key, functools.partial(self._attend_cp, causal=causal))
        return calls

    def _sinks(self) -> dict[str, torch.Tensor]:
        return {} if self.softmax_offset is None else {"sinks": self.softmax_offset}

    def _plain_causal(self, causal: bool) -> bool:
        """Causal attention with no context parallelism, window, ALiBi or sinks (what the packed paths
        of compiled layers and shared prefixes take)."""
        return (
            causal
            and self.cp is None
            and self.window_size == (-1, -1)
            and self.alibi_slopes is None
            and self.softmax_offset is None
        )

    def _attend_packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, causal: bool
    ) -> torch.Tensor:
        # THD: megatron hands [t, n, d] (the batch of one squeezed out) and reshapes [t, n * d]
        # back itself; the sequences attend only within their cu_seqlens segment.
        if params.qkv_format != "thd":
            raise ValueError(
                f"packed sequences in qkv_format={params.qkv_format!r} are not supported by "
                "RegistryAttention; use qkv_format='thd'"
            )
        if isinstance(params, CompiledPackedParams):
            # Inside a compiled layer: the eager per-segment attention as one opaque op (mindspeed.megatron.compiled_packing).
            if not self._plain_causal(causal):
                raise ValueError(
                    "compiled layers take packed microbatches with causal attention only (no context "
                    "parallelism, window, ALiBi or sinks); set train.compile=false"
                )
            if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
                # Keep what the backward needs (no attention forward recomputed in it).
                out, _ = packed_attention_saved(query, key, value, self.softmax_scale, self.impl)
            else:
                out = packed_attention(query, key, value, self.softmax_scale, self.impl)
            return out.reshape(query.shape[0], -1)
        if isinstance(params, SharedPrefixParams):
            # One prompt and its responses in one segment (GRPO groups): see mindspeed.megatron.shared_prefix.
            if not self._plain_causal(causal):
                raise ValueError(
                    "shared-prefix packing needs causal attention without context parallelism, a window, ALiBi "
                    "or sinks; "
                    "pack each sequence on its own"
                )
            out = attend_shared_prefix(self.kernel, query, key, value, params, self.softmax_scale)
            return out.reshape(query.shape[0], -1)
        cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
            raise ValueError("RegistryAttention needs cu_seqlens_q == cu_seqlens_kv for packed sequences")
        if self.cp is not None:
            if self.alibi_slopes is not None and self.cp.algo not in (RING, KVALLGATHER):
                raise ValueError(
                    "packed sequences with ALiBi under context parallelism need cp_comm_type 'p2p' (ring) or "
                    "'all_gather'; use one of them, context_parallel_size=1 or unpacked sequences"
                )
            out = self.cp.attend_packed(
                query.unsqueeze(0),
                key.unsqueeze(0),
                value.unsqueeze(0),
                cu_q,
                causal=causal,
                softmax_scale=self.softmax_scale,
                kernel=self.kernel,
                impl=self.impl,
                features=self.features,
                window_size=self.window_size,
                **self._alibi_kwargs(query.device),
            )
            return out.squeeze(0).reshape(query.shape[0], -1)
        out = self.kernel(
            query.unsqueeze(0),
            key.unsqueeze(0),
            value.unsqueeze(0),
            causal=causal,
            softmax_scale=self.softmax_scale,
            window_size=self.window_size,
            cu_seqlens=cu_q,
            **self._sinks(),
            **self._alibi_kwargs(query.device),
        )
        return out.squeeze(0).reshape(query.shape[0], -1)

    def _alibi_kwargs(self, device: torch.device, ulysses_group: Any = None) -> dict[str, torch.Tensor]:
        """``{"alibi_slopes": ...}`` on ``device`` in fp32 for an ALiBi layer, else nothing.

        Under Ulysses, the slopes of the heads this rank attends after the all-to-all (rank
        ``j`` of ``U`` gets the ``j``-th ``1/U`` of its tensor-parallel heads). Not a buffer
        (``Float16Module`` would cast it to half precision); one tensor per (heads, ranks,
        device) shared by all layers, so their bias is built once a step.
        """
        if self.alibi_slopes is None:
            return {}
        part, parts = (0, 1) if ulysses_group is None else (ulysses_group.rank(), ulysses_group.size())
        return {"alibi_slopes": _slopes_on(*self.alibi_slopes, device, part, parts)}


def _alibi_slopes(config: Any, pg_collection: Any) -> tuple[int, int, int]:
    """``(heads, tp rank, tp size)`` of this rank's ALiBi slopes (checked; see :func:`_slopes_on`)."""
    tp_group = getattr(pg_collection, "tp", None)
    if tp_group is None:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    heads, rank, size = config.num_attention_heads, tp_group.rank(), tp_group.size()
    shard_alibi_slopes(heads, rank, size)  # raises now, at build time, if the heads do not split
    return heads, rank, size


@functools.cache
def _slopes_on(heads: int, rank: int, size: int, device: torch.device, part: int = 0, parts: int = 1) -> torch.Tensor:
    """ALiBi slopes, fp32 on ``device`` (one tensor per key): of tensor-parallel rank ``rank`` of
    ``size``'s consecutive heads, and of those the ``part``-th of ``parts`` (Ulysses)."""
    return shard_alibi_slopes(heads, rank, size).chunk(parts)[part].contiguous().to(device)


#: Hybrid sub-groups per (CP group, Ulysses degree): every layer of a model shares them, and
#: ``new_group`` is collective, so they are created once (at the first layer's construction).
_HYBRID_GROUPS: dict[tuple[int, int, int], ContextParallelGroups] = {}


def _hybrid_groups(cp_group: Any, degree: int, cp_window_size: int = 1) -> ContextParallelGroups:
    """Hybrid's sub-groups (``degree``), or the double ring's (``cp_window_size > 1``), once per CP group."""
    algo = HYBRID if cp_window_size == 1 else RING
    key = (id(cp_group), degree, cp_window_size)
    groups = _HYBRID_GROUPS.get(key)
    if groups is None or groups.cp_group is not cp_group:  # an id reused after a group was destroyed
        groups = _HYBRID_GROUPS[key] = build_context_parallel_groups(
            cp_group, algo, degree, cp_window_size=cp_window_size
        )
    return groups


class _ContextParallel:
    """The CP side of :class:`RegistryAttention`: groups, algorithm and the layout fix-up.

    Layout. Inside megatron-core the data is split by megatron's zig-zag rule for EVERY
    algorithm: megatron's ``RotaryEmbedding`` cuts the rope frequencies with
    ``get_pos_emb_on_this_cp_rank`` (chunks ``r`` and ``2C - 1 - r`` of ``2C``), and it has no
    seam to do otherwise. That is exactly ``megatron_cp_algo``'s layout, so the ring runs as
    is. Ulysses (and hybrid's Ulysses stage) all-to-alls the shards of its group back into one
    sequence whose order is the concatenation of the members' zig-zag shards: a permutation
    known in advance. Attention is permutation-equivariant in the rows as long as the mask is
    applied by true position, so the gathered rows are sorted into ascending position (one
    ``index_select`` of q, k, v, and its inverse on the output), attended, and put back. For
    Ulysses the sorted rows are the whole sequence in natural order; for hybrid they are
    exactly ring rank ``rho``'s zig-zag shard over the ``R`` ring ranks (the ``U`` CP ranks of
    ring rank ``rho`` hold chunks ``rho U .. rho U + U - 1`` and their mirrors, i.e. ring chunks
    ``rho`` and ``2R - 1 - rho``), in the ring's ascending local order. No extra communication
    and no change to rope or the data loader.
    """

    def __init__(self, config: Any, cp_comm_type: str | None, pg_collection: Any) -> None:
        if cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={cp_comm_type!r} is not supported by RegistryAttention; "
                f"use one of {sorted(k for k in CP_COMM_TYPES if k)} (p2p: ring, a2a: Ulysses, "
                "a2a+p2p: hybrid, all_gather: KV all-gather)"
            )
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group, self.cp_size = cp_group, config.context_parallel_size
        if cp_group.size() != self.cp_size:
            raise ValueError(f"the CP group has {cp_group.size()} ranks but context_parallel_size is {self.cp_size}")
        self.algo = CP_COMM_TYPES[cp_comm_type]
        self.ulysses_group: Any = None
        self.ring_group: Any = None
        # MindSpeed's settings that megatron's TransformerConfig has no field for (the
        # context_parallel feature sets them as attributes): the double ring's window and
        # adaptive CP, both on the ring's zig-zag layout ("p2p").
        self.window = int(getattr(config, "cp_window_size", 1) or 1)
        self.adaptive = bool(getattr(config, "cp_adaptive", False))
        self.inner_ring_group: Any = None
        self.outer_ring_group: Any = None
        if (self.window > 1 or self.adaptive) and self.algo != RING:
            raise ValueError(
                f"cp_window_size / adaptive CP run on the ring's layout: they need cp_comm_type 'p2p', not "
                f"{cp_comm_type!r}; set cp_window_size=1 and cp_adaptive=False or use the ring"
            )
        if self.window > 1:
            groups = _hybrid_groups(cp_group, 1, self.window)
            self.inner_ring_group, self.outer_ring_group = groups.inner_ring_group, groups.outer_ring_group
        if self.algo == ULYSSES:
            self.ulysses_group = cp_group
        elif self.algo == HYBRID:
            sizes = config.hierarchical_context_parallel_sizes
            if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != self.cp_size:
                raise ValueError(
                    f"cp_comm_type='a2a+p2p' needs hierarchical_context_parallel_sizes=[U, R] with "
                    f"U * R = context_parallel_size ({self.cp_size}); got {sizes}"
                )
            groups = _hybrid_groups(cp_group, sizes[0])
            self.ulysses_group, self.ring_group = groups.ulysses_group, groups.ring_group
        self._orders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sort, unsort)`` of the rows the Ulysses all-to-all gathers (see the class doc)."""
        if seq_len not in self._orders:
            degree = self.ulysses_group.size()
            first = self.cp_group.rank() // degree * degree  # the Ulysses group is U consecutive CP ranks
            positions = torch.cat(
                [
                    torch.arange(start, stop)
                    for member in range(first, first + degree)
                    for start, stop in shard_ranges(seq_len, member, self.cp_size, RING)
                ]
            )
            sort = torch.argsort(positions)
            self._orders[seq_len] = (sort, torch.argsort(sort))
        sort, unsort = self._orders[seq_len]
        return sort.to(device), unsort.to(device)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float | None,
        kernel: Any,
        impl: str,
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's rows of attention over the whole sequence; BSND zig-zag shards in and out.

        ``alibi_slopes`` (ring, Ulysses and KV all-gather): the slopes of the heads this rank attends
        (after Ulysses' all-to-all, its part of them); Ulysses' sorted rows are the whole sequence
        in position order and KV all-gather aligns every call by global position, so the bias is
        exact. ``window_size``: KV all-gather only (the caller checks).
        """
        seq_len = q.shape[1] * self.cp_size
        if seq_len % (2 * self.cp_size):
            raise ValueError(
                f"sequence length {seq_len} must be divisible by 2 * context_parallel_size "
                f"({2 * self.cp_size}), as megatron's zig-zag split of data and rope needs"
            )
        algo = self.algo
        if self.adaptive:  # unpacked rows are one sequence: the ring, or the all-gather for a window
            algo = choose_cp_algo(seq_len, self.cp_size, causal, None, tuple(window_size), alibi_slopes is not None)
            algo = algo.algo
        if algo == KVALLGATHER:
            # Megatron's zig-zag is exactly this algorithm's layout: no reordering.
            return kv_allgather_attention(
                q,
                k,
                v,
                group=self.cp_group,
                seq_len=seq_len,
                causal=causal,
                softmax_scale=1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
                bounds=None,
                attend=kernel,
                window_size=window_size,
                alibi_slopes=alibi_slopes,
            )
        if algo == RING:
            return context_parallel_attention(
                q,
                k,
                v,
                algo=RING,
                cp_group=self.cp_group,
                causal=causal,
                softmax_scale=softmax_scale,
                seq_len=seq_len,
                impl=impl,
                inner_ring_group=self.inner_ring_group,
                outer_ring_group=self.outer_ring_group,
                alibi_slopes=alibi_slopes,
            )
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        sort, unsort = self._order(seq_len, q.device)
        ring_group = self.ring_group
        alibi = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}

        def attend_sorted(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            *,
            causal: bool,
            softmax_scale: float,
            cu_seqlens: Any = None,
        ) -> torch.Tensor:
            q, k, v = (t.index_select(1, sort) for t in (q, k, v))
            if ring_group is None or ring_group.size() == 1:
                out = kernel(q, k, v, causal=causal, softmax_scale=softmax_scale, **alibi)
            else:
                out = context_parallel_attention(
                    q,
                    k,
                    v,
                    algo=RING,
                    cp_group=ring_group,
                    causal=causal,
                    softmax_scale=softmax_scale,
                    seq_len=seq_len,
                    impl=impl,
                )
            return out.index_select(1, unsort)

        gathered = seq_len // (1 if ring_group is None else ring_group.size())
        return ulysses_attention(
            q,
            k,
            v,
            group=self.ulysses_group,
            seq_len=gathered,
            causal=causal,
            softmax_scale=scale,
            cu_seqlens=None,
            attend=attend_sorted,
        )

    def _packed_order(self, bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sort, unsort)`` of the rows the Ulysses all-to-all gathers from per-sequence zig-zag shards.

        Not cached: every packed microbatch has its own boundaries.
        """
        degree = self.ulysses_group.size()
        first = self.cp_group.rank() // degree * degree
        positions = torch.cat(
            [
                torch.arange(start, stop)
                for member in range(first, first + degree)
                for start, stop in packed_shard_ranges(bounds, member, self.cp_size)
            ]
        )
        sort = torch.argsort(positions)
        return sort.to(device), torch.argsort(sort).to(device)

    def attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float | None,
        kernel: Any,
        impl: str,
        features: tuple[str, ...] = (),
        window_size: tuple[int, int] = (-1, -1),
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed (THD) attention; ``[1, t_local, n, d]`` shards split zig-zag per sequence (megatron's layout).

        KV all-gather runs on those shards directly too (with the layer's kernel features, its
        window and ALiBi slopes, which only it takes here).

        The ring runs on the per-sequence shards directly (they ascend in global position). Ulysses
        gathers its group's shards, sorts them into position order (the whole row for Ulysses;
        for hybrid, ring rank ``rho``'s per-sequence zig-zag shard over the ``R`` ring ranks, as
        every sequence's ``2C`` chunks group into ``2R`` ring chunks of ``U``), attends and unsorts.
        """
        bounds = tuple(int(b) for b in cu_seqlens.tolist())
        seq_len = bounds[-1]
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        device = get_accelerator().name
        algo = self.algo
        if self.adaptive:  # per microbatch: its documents decide (see mindspeed.parallel.context_parallel.adaptive)
            algo = choose_cp_algo(
                seq_len, self.cp_size, causal, bounds, tuple(window_size), alibi_slopes is not None, per_sequence=True
            ).algo
        if algo == LOCAL:  # every document inside one rank's chunks: nothing to communicate
            cu = local_cu_seqlens(packed_shard_ranges(bounds, self.cp_group.rank(), self.cp_size), bounds)
            local = _kernel("attention", impl, (*features, FEATURE_VARLEN), device)
            cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=q.device)
            alibi = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}  # segments are consecutive
            return local(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu, **alibi)
        if algo == KVALLGATHER:
            return kv_allgather_attention(
                q,
                k,
                v,
                group=self.cp_group,
                seq_len=seq_len,
                causal=causal,
                softmax_scale=scale,
                bounds=bounds,
                attend=_kernel("attention", impl, (*features, FEATURE_VARLEN), device),
                window_size=window_size,
                alibi_slopes=alibi_slopes,
                per_sequence=True,
            )
        ring_group = self.cp_group if self.algo == RING else self.ring_group
        lse_kernel = update = None
        if ring_group is not None and ring_group.size() > 1:  # only the ring merges blocks by their lse
            alibi = (FEATURE_ALIBI, FEATURE_ALIBI_OFFSET) if alibi_slopes is not None else ()
            lse_kernel = _kernel("attention", impl, (FEATURE_LSE, FEATURE_VARLEN, *alibi), device)
            update = _kernel("ring_attention_update", "auto", (), device)
        if algo == RING and self.inner_ring_group is not None:
            return double_ring_attention(
                q,
                k,
                v,
                inner_group=self.inner_ring_group,
                outer_group=self.outer_ring_group,
                seq_len=seq_len,
                causal=causal,
                softmax_scale=scale,
                bounds=bounds,
                attend=lse_kernel,
                update=update,
                per_sequence=True,
                alibi_slopes=alibi_slopes,
            )
        if algo == RING:
            return ring_attention(
                q,
                k,
                v,
                group=self.cp_group,
                seq_len=seq_len,
                causal=causal,
                softmax_scale=scale,
                bounds=bounds,
                attend=lse_kernel,
                update=update,
                per_sequence=True,
                alibi_slopes=alibi_slopes,
            )
        sort, unsort = self._packed_order(bounds, q.device)
        varlen = _kernel("attention", impl, (FEATURE_VARLEN,), device)

        def attend_sorted(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            *,
            causal: bool,
            softmax_scale: float,
            cu_seqlens: Any = None,
        ) -> torch.Tensor:
            q, k, v = (t.index_select(1, sort) for t in (q, k, v))
            if ring_group is None or ring_group.size() == 1:
                out = varlen(
                    q,
                    k,
                    v,
                    causal=causal,
                    softmax_scale=softmax_scale,
                    cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=q.device),
                )
            else:
                out = ring_attention(
                    q,
                    k,
                    v,
                    group=ring_group,
                    seq_len=seq_len,
                    causal=causal,
                    softmax_scale=softmax_scale,
                    bounds=bounds,
                    attend=lse_kernel,
                    update=update,
                    per_sequence=True,
                )
            return out.index_select(1, unsort)

        gathered = seq_len // (1 if ring_group is None else ring_group.size())
        return ulysses_attention(
            q,
            k,
            v,
            group=self.ulysses_group,
            seq_len=gathered,
            causal=causal,
            softmax_scale=scale,
            cu_seqlens=None,
            attend=attend_sorted,
        )
