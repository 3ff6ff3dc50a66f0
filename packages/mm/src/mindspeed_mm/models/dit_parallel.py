"""Ulysses sequence parallelism inside a diffusers transformer, through its attention processors and module hooks.

``U`` ranks of a sequence-parallel group hold the same microbatch. :func:`apply_sequence_parallel`
changes nothing in the model's code; it adds, from the family's :class:`SequencePlan`:

1. forward hooks that keep this rank's contiguous ``1/U`` of the per-token tensors where the
   family says (Wan: the rotary table out of ``rope`` and the video tokens into ``blocks.0``;
   FLUX: the text and image tokens and their position ids at the model's input), so every block
   works on a shard (uneven lengths split as ``torch.tensor_split`` does);
2. a wrapper around every attention processor (diffusers' processor seam,
   ``set_attn_processor``) that runs the model's own processor with diffusers' native backend and
   hands its ``scaled_dot_product_attention`` call to the core's Ulysses all-to-all
   (:func:`mindspeed.parallel.context_parallel.comm.seq_to_heads`, the kernel registry's
   ``attention`` op, :func:`~mindspeed.parallel.context_parallel.comm.heads_to_seq`): each rank
   attends over the whole sequence for ``1/U`` of the heads. Or to the core's ring attention over the
   group (``megatron_cp_algo``), or to its hybrid (``hybrid_cp_algo``, USP: Ulysses inside groups of
   ``U`` consecutive ranks, the ring across them). A boolean key mask (Qwen-Image's text mask) is gathered with
   the keys under Ulysses, and travels with the keys as an additive bias channel under the ring and USP
   (:func:`_key_bias_channels`). The attention is not causal, so contiguous shards
   serve the ring's layouts as long as every rank holds as many tokens as the layout gives it (the
   splits cut by those lengths). Cross-attention to replicated text
   (Wan's ``attn2``) stays local: each rank's queries see all the text keys. A self-attention over
   only some of the split streams (SD3.5's dual-attention ``attn2``: the image tokens, called without
   ``encoder_hidden_states``) runs over those streams' shards (:attr:`SequencePlan.self_attention`): its
   own all-to-all (or ring) with the image shards' sizes;
3. a forward hook that gathers the output projection's tokens from the group (its backward
   keeps this rank's rows), so the model returns the whole prediction on every rank.

The gradient of a split keeps this rank's rows, so every parameter's gradient summed over the
group is the unsplit model's (FSDP2 sums it: the task scales its loss by ``U``).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mindspeed.device import get_accelerator
from mindspeed.ops import resolve_kernel
from mindspeed.ops.attention import FEATURE_LSE
from mindspeed.parallel.context_parallel.comm import heads_to_seq, seq_to_heads
from mindspeed.parallel.context_parallel.groups import ContextParallelGroups, build_context_parallel_groups
from mindspeed.parallel.context_parallel.hybrid import hybrid_attention
from mindspeed.parallel.context_parallel.layout import HYBRID, RING, ULYSSES, shard_lengths
from mindspeed.parallel.context_parallel.ring import ring_attention


@dataclass(frozen=True)
class Split:
    """A per-token tensor to cut along ``dim``: an input (``arg``: keyword name or position) or the output (None).

    Attributes:
        module: the module's name in the model (``""``: the model itself; ``{*}`` matches one name part, so
            ``transformer_blocks.{*}`` cuts that input of every block).
        arg: the keyword (or positional index) of the input; None: every tensor of the output.
        dim: the token dimension.
        name: the tokens it holds, when they are tokens of the attention sequence (``video``,
            ``text``, ``image``): their shard sizes make the attention's sizes and size the gather.
        ndim: split only a tensor of this many dimensions (Wan2.2 TI2V's timestep: ``[B, S]`` per token,
            ``[B]`` per sample left whole); None: always.
    """

    module: str
    arg: str | int | None
    dim: int
    name: str | None = None
    ndim: int | None = None


@dataclass(frozen=True)
class SequencePlan:
    """Where a family's tokens are split, where they are gathered, and which attention is sequence parallel.

    Attributes:
        splits: the tensors cut into shards.
        gather: ``(module, dim, split name)``: the module whose output is gathered along ``dim`` with the
            shard sizes of the named split.
        cross_attention_local: attention with ``encoder_hidden_states`` (Wan's cross-attention to the
            replicated text) runs on the local queries without communication; False: every attention is
            over the split sequence (FLUX's joint text + image attention).
        self_attention: the named splits whose tokens an attention called without ``encoder_hidden_states``
            attends over (SD3's ``("image",)``: SD3.5's dual-attention ``attn2`` sees the image stream only, where
            the joint ``attn`` sees both); None: all of them (FLUX's single-stream blocks, Wan's self-attention).
    """

    splits: tuple[Split, ...]
    gather: tuple[str, int, str]
    cross_attention_local: bool = True
    self_attention: tuple[str, ...] | None = None


@functools.lru_cache(maxsize=8)
def _kernel(op: str, device: str, features: tuple[str, ...] = ()) -> Any:
    return resolve_kernel(op, "auto", device=device, features=features)


class _GatherTokens(torch.autograd.Function):
    """All-gather uneven shards along ``dim``; the backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, dim: int, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:rank]), sizes[rank]
        widest = max(sizes)
        padded = shard
        if shard.shape[dim] < widest:
            pad = list(shard.shape)
            pad[dim] = widest - shard.shape[dim]
            padded = torch.cat([shard, shard.new_zeros(pad)], dim=dim)
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, sizes)], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None, None


@dataclass
class SequenceParallel:
    """The state of one model's sequence parallelism: its group and the shard sizes of the current forward.

    Attributes:
        group: the sequence-parallel group (its rank order is the shard order).
        plan: the family's plan.
        sizes: shard sizes over the group of each named split of the current forward.
        calls: sequence-parallel attention calls so far (tests check it ran).
        masked_calls: those with a key mask.
        algo: ``ulysses_cp_algo``, ``megatron_cp_algo`` (the core's ring attention over the group:
            non-causal, so the contiguous shards serve as well as its zig-zag ones when all are as long)
            or ``hybrid_cp_algo`` (USP: :attr:`groups` holds its Ulysses and ring groups).
        groups: the Ulysses and ring groups of ``group`` (``build_context_parallel_groups``).
    """

    group: dist.ProcessGroup
    plan: SequencePlan
    algo: str = ULYSSES
    groups: ContextParallelGroups | None = None
    sizes: dict[str, list[int]] = field(default_factory=dict)
    calls: int = 0
    masked_calls: int = 0
    handles: list[Any] = field(default_factory=list)
    processors: list[dict[str, Any]] = field(default_factory=list)
    nested: bool = False

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's place in the group."""
        return dist.get_rank(self.group)

    @property
    def ulysses_degree(self) -> int:
        """Ranks that split the heads: the group (Ulysses), 1 (ring), the Ulysses groups' size (hybrid)."""
        if self.algo == RING:
            return 1
        if self.algo == HYBRID:
            return dist.get_world_size(self.groups.ulysses_group)
        return self.size

    def layout(self, length: int) -> list[int]:
        """Every rank's share of ``length`` tokens: near-equal (Ulysses), the ring's zig-zag shard lengths
        (ring), each ring shard's near-equal pieces over its Ulysses group (hybrid)."""
        return shard_lengths(length, self.size, self.algo, self.ulysses_degree)

    def split(self, tensor: torch.Tensor, split: Split) -> torch.Tensor:
        """This rank's contiguous shard of ``tensor`` along ``split.dim`` (recording its sizes under its name)."""
        length = tensor.shape[split.dim]
        sizes = self.layout(length)
        if min(sizes) == 0:
            raise ValueError(
                f"{length} tokens cannot be split over the {self.size} sequence-parallel ranks "
                f"({self.algo}: shares {sizes}); use larger latents or smaller parallel.ulysses_parallel_size / "
                "parallel.ring_attention_size"
            )
        if split.name is not None:
            self.sizes[split.name] = sizes
        return tensor.narrow(split.dim, sum(sizes[: self.rank]), sizes[self.rank])

    def split_model_inputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` of the model's ``forward`` with the plan's splits of the model's own inputs applied (for
        inputs put back after the split hooks ran: the task's float32 timesteps). A Wan2.2 pair's experts split
        their own inputs after the pair's hooks: nothing to do there."""
        if self.nested:
            return kwargs
        splits = [s for s in self.plan.splits if s.module == "" and isinstance(s.arg, str)]
        return _split_inputs(self, splits, None, (), dict(kwargs))[1]

    def attention_sizes(self, names: tuple[str, ...] | None = None) -> list[int]:
        """Every rank's length of the attention sequence: the sum over the named splits of this forward (``names``:
        those splits only)."""
        columns = self.sizes.values() if names is None else [self.sizes[name] for name in names]
        return [sum(column) for column in zip(*columns)]

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        *,
        names: tuple[str, ...] | None = None,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention``'s signature (``[B, heads, S_local, D]``) over the whole sequence (``names``:
        over those named splits' tokens only, see :attr:`SequencePlan.self_attention`)."""
        key_mask = attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.shape[1:3] == (1, 1)
        if (attn_mask is not None and not key_mask) or dropout_p > 0.0 or is_causal:
            raise ValueError(
                "sequence parallelism of a diffusion transformer needs attention without dropout or causality, "
                "and a mask only as a boolean key mask ([B, 1, 1, S]); set parallel.ulysses_parallel_size=1 and "
                "parallel.ring_attention_size=1 for this model"
            )
        heads = query.shape[1]
        if heads % self.ulysses_degree or key.shape[1] != heads:
            raise ValueError(
                f"parallel.ulysses_parallel_size={self.ulysses_degree} does not divide the {heads} attention heads "
                f"({key.shape[1]} key heads); use a divisor of the head count"
            )
        sizes = self.attention_sizes(names)
        if query.shape[2] != sizes[self.rank]:
            raise ValueError(
                f"an attention over {query.shape[2]} local tokens where the plan's splits "
                f"({'all' if names is None else ', '.join(names)}) give this rank {sizes[self.rank]}: the model "
                "attends over a sequence its family's sequence plan does not describe; set "
                "parallel.ulysses_parallel_size=1 and parallel.ring_attention_size=1 for this model"
            )
        softmax_scale = scale if scale is not None else query.shape[-1] ** -0.5
        device = get_accelerator().name
        self.calls += 1
        self.masked_calls += attn_mask is not None
        if self.algo in (RING, HYBRID):
            if attn_mask is None:
                return self._ring(query, key, value, sizes, softmax_scale, device)
            width = value.shape[-1]
            biased = _key_bias_channels(query, key, value, attn_mask, softmax_scale)
            return self._ring(*biased, sizes, softmax_scale, device)[..., :width]
        q, k, v = seq_to_heads([x.transpose(1, 2) for x in (query, key, value)], self.group, sizes)
        if attn_mask is not None:  # every rank's keys, in the group order seq_to_heads gathered them
            mask = _gather_key_mask(attn_mask, sizes, self.group)
            out = F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask, scale=softmax_scale
            ).transpose(1, 2)
        else:
            out = _kernel("attention", device)(q, k, v, causal=False, softmax_scale=softmax_scale)
        return heads_to_seq([out], self.group, sizes)[0].transpose(1, 2)

    def _ring(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], scale: float, device: str
    ) -> torch.Tensor:
        seq_len = sum(sizes)
        if sizes != self.layout(seq_len):
            raise ValueError(
                f"parallel.context_parallel_algo={self.algo} needs every rank's share of the attention sequence as "
                f"its layout gives it ({self.layout(seq_len)} of {seq_len} tokens); the splits made {sizes}: use "
                f"latents whose tokens (and text) divide by 2 x {self.size}, or ulysses_cp_algo"
            )
        common = dict(
            seq_len=seq_len,
            causal=False,
            softmax_scale=scale,
            bounds=None,
            attend=_kernel("attention", device, (FEATURE_LSE,)),
            update=_kernel("ring_attention_update", device),
        )
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        if self.algo == HYBRID:
            out = hybrid_attention(
                q, k, v, ulysses_group=self.groups.ulysses_group, ring_group=self.groups.ring_group, **common
            )
        else:
            out = ring_attention(q, k, v, group=self.group, **common)
        return out.transpose(1, 2)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole sequence of the gathered module's output, on every rank."""
        _, dim, name = self.plan.gather
        return _GatherTokens.apply(tensor, dim, self.sizes[name], self.group)

    def remove(self, model: torch.nn.Module) -> None:
        """Undo :func:`apply_sequence_parallel`: the hooks and the model's own processors come back."""
        for handle in self.handles:
            handle.remove()
        for root, processors in zip(_roots(model), self.processors):
            root.set_attn_processor(dict(processors))
        self.handles.clear()
        self.processors.clear()


#: The score a masked key gets under ring attention: ``exp`` of it underflows to 0 in float32 (as ``-inf`` does).
_MASKED_SCORE = -1.0e4
#: Channels added to the head dimension for the key bias (a multiple of 8, as fused attention kernels want).
_BIAS_CHANNELS = 8


def _key_bias_channels(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` ``[B, H, S, D]`` with :data:`_BIAS_CHANNELS` more channels that add a per-key bias to the scores.

    A boolean key mask ``[B, 1, 1, S_local]`` of this rank's keys becomes the additive bias 0 (kept) or
    :data:`_MASKED_SCORE` (masked) that ring attention's kernels take as one more product in ``q . k``: the
    queries' first extra channel is ``scale^-1/2``, the keys' is ``bias scale^-1/2`` (so ``scale x q . k`` gains
    exactly ``bias``), the other extra channels and the values' are zero. The keys' bias channel travels
    around the ring (and through USP's all-to-all) with its keys; a masked key's weight is ``exp(-1e4)``,
    0 in float32, and a kept key's score is unchanged (its extra products are zeros). The caller drops the
    output's extra channels.
    """
    root = scale**-0.5
    bias = torch.where(mask.reshape(mask.shape[0], 1, -1, 1), 0.0, _MASKED_SCORE * root).to(key.dtype)
    extra = [_BIAS_CHANNELS - 1]
    q_extra = torch.cat([query.new_full((*query.shape[:3], 1), root), query.new_zeros(*query.shape[:3], *extra)], -1)
    k_extra = torch.cat([bias.expand(*key.shape[:3], 1), key.new_zeros(*key.shape[:3], *extra)], -1)
    return (
        torch.cat([query, q_extra], -1),
        torch.cat([key, k_extra], -1),
        torch.cat([value, value.new_zeros(*value.shape[:3], _BIAS_CHANNELS)], -1),
    )


def _gather_key_mask(mask: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """A boolean key mask ``[B, 1, 1, S_local]`` of this rank's tokens -> ``[B, 1, 1, sum(sizes)]`` of the group's."""
    widest = max(sizes)
    padded = torch.cat([mask, mask.new_zeros(*mask.shape[:3], widest - mask.shape[3])], dim=3)
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=3)


class _UlyssesSDPA(TorchFunctionMode):
    """Hands ``F.scaled_dot_product_attention`` calls to :meth:`SequenceParallel.attend`; everything else runs as is."""

    def __init__(self, parallel: SequenceParallel, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.parallel, self.names, self.calls = parallel, names, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.parallel.attend(*args, **kwargs, names=self.names)
        return func(*args, **kwargs)


class SequenceParallelProcessor:
    """Wraps a diffusers attention processor: its attention over the split sequence goes through Ulysses."""

    def __init__(self, processor: Any, parallel: SequenceParallel) -> None:
        from diffusers.models.attention_dispatch import AttentionBackendName

        self.processor, self.parallel = processor, parallel
        if hasattr(processor, "_attention_backend"):
            processor._attention_backend = AttentionBackendName.NATIVE  # the path that calls SDPA

        # diffusers' Attention.forward drops the keywords its processor's __call__ does not name (Qwen-Image's
        # encoder_hidden_states_mask and image_rotary_emb): the wrapper shows the wrapped processor's signature.
        def call(*args: Any, **kwargs: Any) -> Any:
            return type(self).__call__(self, *args, **kwargs)

        call.__signature__ = inspect.signature(processor.__call__)  # type: ignore[attr-defined]
        self.__call__ = call

    def __call__(
        self, attn: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, *args, **kwargs
    ) -> Any:
        if encoder_hidden_states is not None and self.parallel.plan.cross_attention_local:
            return self.processor(attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        plan = self.parallel.plan
        mode = _UlyssesSDPA(self.parallel, plan.self_attention if encoder_hidden_states is None else None)
        with mode:
            out = self.processor(attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        if mode.calls == 0:
            raise ValueError(
                f"{type(self.processor).__name__} did not call scaled_dot_product_attention, so sequence "
                "parallelism cannot enter it; use the model's default attention processor"
            )
        return out


def _split_inputs(parallel: SequenceParallel, splits: list[Split], module: Any, args: tuple, kwargs: dict) -> Any:
    args = list(args)
    for split in splits:
        if isinstance(split.arg, int) and split.arg < len(args) and _splits(split, args[split.arg]):
            args[split.arg] = parallel.split(args[split.arg], split)
        elif isinstance(split.arg, str) and kwargs.get(split.arg) is not None and _splits(split, kwargs[split.arg]):
            kwargs[split.arg] = parallel.split(kwargs[split.arg], split)
    return tuple(args), kwargs


def _splits(split: Split, tensor: torch.Tensor) -> bool:
    return split.ndim is None or tensor.ndim == split.ndim


def _split_outputs(parallel: SequenceParallel, split: Split, module: Any, args: tuple, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return parallel.split(output, split)
    return type(output)(parallel.split(x, split) if isinstance(x, torch.Tensor) else x for x in output)


def _modules(model: torch.nn.Module, pattern: str) -> list[str]:
    """The module names ``pattern`` names (``{*}`` matches one name part: ``transformer_blocks.{*}``: every block)."""
    if "{*}" not in pattern:
        return [pattern]
    regex = re.compile(re.escape(pattern).replace(re.escape("{*}"), r"[^.]+"))
    return [name for name, _ in model.named_modules() if regex.fullmatch(name)]


def _roots(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The diffusers transformers inside ``model``: a Wan2.2 pair's two experts, else the model itself."""
    return tuple(getattr(model, "experts", None) or (model,))


def apply_sequence_parallel(
    model: torch.nn.Module,
    plan: SequencePlan,
    group: dist.ProcessGroup,
    algo: str = ULYSSES,
    ulysses_degree: int | None = None,
) -> SequenceParallel:
    """Make ``model`` (a diffusers transformer, sharded or not) split its tokens over ``group`` (see the module doc).

    Args:
        model: the diffusers transformer, or a Wan2.2 :class:`~mindspeed_mm.models.wan_experts.ExpertPair`
            (each expert gets the plan, sharing one state: the experts run one after the other).
        plan: its family's :class:`SequencePlan`.
        group: the sequence-parallel group.
        algo: ``ulysses_cp_algo``, ``megatron_cp_algo`` or ``hybrid_cp_algo``.
        ulysses_degree: for ``hybrid_cp_algo``: the size ``U`` of its Ulysses groups (consecutive ranks of
            ``group``; the ring degree is the rest), created here by every rank of ``group``.

    Raises:
        ValueError: the model uses diffusers' own gradient checkpointing (its recompute would split twice;
            use ``train.recompute_modules``), or the heads do not divide by the Ulysses degree.
    """
    if algo not in (ULYSSES, RING, HYBRID):
        raise ValueError(f"parallel.context_parallel_algo={algo!r}: use {ULYSSES}, {RING} or {HYBRID}")
    groups = build_context_parallel_groups(group, algo, ulysses_degree) if algo == HYBRID else None
    roots = _roots(model)
    parallel = SequenceParallel(group, plan, algo=algo, groups=groups, nested=roots[0] is not model)
    if any(getattr(root, "gradient_checkpointing", False) for root in roots):
        raise ValueError(
            "sequence parallelism with diffusers' gradient checkpointing would split the recomputed blocks' "
            "inputs twice; use train.recompute_modules instead"
        )
    heads = getattr(model.config, "num_attention_heads", None)
    if heads is not None and heads % parallel.ulysses_degree:
        raise ValueError(
            f"parallel.ulysses_parallel_size={parallel.ulysses_degree} does not divide the model's {heads} attention "
            "heads; use a divisor of the head count"
        )
    for root in roots:
        _hook(root, plan, parallel)
    return parallel


def _hook(model: torch.nn.Module, plan: SequencePlan, parallel: SequenceParallel) -> None:
    """The plan's split and gather hooks and the wrapped attention processors, on one diffusers transformer."""
    inputs: dict[str, list[Split]] = {}
    for split in plan.splits:
        for name in _modules(model, split.module):
            if split.arg is None:
                hook = functools.partial(_split_outputs, parallel, split)
                parallel.handles.append(model.get_submodule(name).register_forward_hook(hook))
            else:
                inputs.setdefault(name, []).append(split)
    for name, splits in inputs.items():
        hook = functools.partial(_split_inputs, parallel, splits)
        parallel.handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    gathered = model.get_submodule(plan.gather[0])
    parallel.handles.append(gathered.register_forward_hook(lambda module, args, output: parallel.gather(output)))
    processors = dict(model.attn_processors)
    parallel.processors.append(processors)
    model.set_attn_processor({name: SequenceParallelProcessor(p, parallel) for name, p in processors.items()})
