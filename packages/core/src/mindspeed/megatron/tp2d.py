"""2D tensor parallelism (MindSpeed's ``--tp-2d --tp-x --tp-y``) in megatron-core's dense layers.

The TP group of size ``tp = tp_x * tp_y`` is a grid (:mod:`mindspeed.parallel.tp2d`). Inside a
decoder chunk the hidden states are ``[s / tp_x, b, h / tp_y]`` on every rank (sequence block
``x``, hidden block ``y``); the first layer of a chunk enters that layout from megatron's
replicated ``[s, b, h]`` and the last one leaves it (:func:`install_tp2d_boundaries`), so the
embedding, the final norm, the output layer, the pipeline's send / receive shapes and
everything outside the layers stay megatron's.

- :class:`Tp2dColumnParallelLinear` (``linear_qkv``, ``linear_fc1``): all-gather the input's
  sequence along x, GEMM with the weight block ``[out / tp_x, h / tp_y]``, reduce-scatter the
  output features along y. Rank ``(x, y)`` = TP rank ``x * tp_y + y`` ends with exactly the
  output columns (heads, ``[gate; up]`` pair) 1D TP gives TP rank ``x * tp_y + y``, so the
  attention core, rotary embeddings and the activation run unchanged on the full sequence.
- :class:`Tp2dRowParallelLinear` (``linear_proj``, ``linear_fc2``): all-gather the input
  features along y, GEMM with the weight block ``[h / tp_y, in / tp_x]``, reduce-scatter the
  sequence along x.
- :class:`Tp2dNorm` (``input_layernorm``, ``pre_mlp_layernorm``): the distributed norm: each
  rank's statistics of its hidden block all-reduced along y.

Norm weights and row biases stay whole on every rank (as in 1D TP); each rank uses its hidden
block and the gradient is summed over the TP group. Weight blocks are contiguous blocks of the
1D shards of the same TP ranks, so :func:`tp2d_to_1d_state` / :func:`load_1d_state_into_tp2d`
convert a model's state to and from the 1D TP layout (same parameter names).
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from mindspeed.parallel.tp2d import (
    Tp2dGroups,
    _block,
    _gather,
    _reduce_scatter,
    all_reduce_along,
    build_tp2d_groups,
    enter_2d,
    exit_2d,
    reduce_scatter_along,
    slice_with_reduced_grad,
)

__all__ = [
    "Tp2dColumnParallelLinear",
    "Tp2dNorm",
    "Tp2dRowParallelLinear",
    "apply_tp2d",
    "column_block",
    "install_tp2d_boundaries",
    "load_1d_state_into_tp2d",
    "row_block",
    "tp2d_to_1d_state",
]


def _shard_1d(full: torch.Tensor, rank: int, size: int, stride: int = 1, dim: int = 0) -> torch.Tensor:
    # megatron's rule (_initialize_affine_weight_cpu): stride * size blocks, rank r takes r, r + size, ...
    blocks = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
    return torch.cat(blocks[rank::size], dim=dim)


def column_block(full: torch.Tensor, groups: Tp2dGroups, stride: int = 1) -> torch.Tensor:
    """Rank ``(x, y)``'s block of a column weight ``[out, in]`` (or bias ``[out]``, returned 1D).

    The output rows are the 1D shards of TP ranks ``x * tp_y + 0 .. tp_y - 1`` one after the
    other; a weight's input columns are block ``y`` of ``tp_y``.
    """
    g = groups
    rows = torch.cat([_shard_1d(full, g.x_rank * g.tp_y + j, g.tp, stride) for j in range(g.tp_y)])
    return rows if full.dim() == 1 else _block(rows, 1, g.y_rank, g.tp_y)


def row_block(full: torch.Tensor, groups: Tp2dGroups) -> torch.Tensor:
    """Rank ``(x, y)``'s block of a row weight ``[h, in]``: rows block ``y``, input columns block ``x``."""
    return _block(_block(full, 1, groups.x_rank, groups.tp_x), 0, groups.y_rank, groups.tp_y)


def _tp_group(tp_group: Any) -> Any:
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def _full_weight(config: Any, init_method: Any, rows: int, cols: int) -> torch.Tensor:
    # As megatron's CPU initialisation: the whole weight from the default generator, then cut;
    # a 2D model therefore starts from the weights of the 1D (and the single-rank) model.
    if not config.perform_initialization:  # weights come from a checkpoint: no values to draw
        return torch.empty(rows, cols, dtype=config.params_dtype)
    full = torch.empty(rows, cols, dtype=torch.float32)
    init_method(full)
    return full.to(config.params_dtype)


def _mark(param: nn.Parameter) -> None:
    # Unique per TP rank: megatron counts it in the gradient norm on every rank. (Its 1D
    # partition attributes do not describe a 2D block; nothing in megatron's step reads them.)
    param.tensor_model_parallel = True
    param.partition_dim = 0
    param.partition_stride = 1


class _Tp2dLinear(nn.Module):
    """What both 2D linears share: checkpoints in the global (1D TP) layout.

    ``sharded_state_dict`` (megatron's distributed checkpoints, what the trainer saves) declares
    the weight as this rank's 2D block of the same global tensor 1D TP declares (two sharded
    axes; SwiGLU's fc1 as a gate block and an up block of megatron's ``[gate; up]`` layout), so
    the optimizer's moments follow the weights and distributed checkpointing reshards between
    1D and 2D runs. ``load_state_dict`` accepts this rank's 2D block or its TP rank's 1D shard.
    """

    tp2d: Tp2dGroups
    weight: nn.Parameter
    #: The weight dimension megatron's 1D TP splits (0 column, 1 row).
    partition_dim: int = 0
    stride: int = 1

    def weight_1d(self) -> torch.Tensor:
        """This TP rank's 1D shard of the weight (collective over the y group)."""
        g, w = self.tp2d, self.weight.detach()
        other = 1 - self.partition_dim
        return _block(_gather(w, other, g.y_group), self.partition_dim, g.y_rank, g.tp_y)

    def weight_from_1d(self, shard: torch.Tensor) -> torch.Tensor:
        """The 2D block of this rank from its TP rank's 1D shard (collective over the y group)."""
        g = self.tp2d
        gathered = _gather(shard.contiguous(), self.partition_dim, g.y_group)
        return _block(gathered, 1 - self.partition_dim, g.y_rank, g.tp_y)

    def get_extra_state(self) -> None:
        """As megatron's linears (their ``_extra_state`` entry), so state dicts have the same keys."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        """The weight as its 2D block of megatron's global tensor; bias and extra state as megatron's."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("2D TP checkpoints: singleton_local_shards is not supported; save without it")
        rest: dict[str, Any] = {"_extra_state": None}
        if self.bias is not None:
            rest["bias"] = self.bias
        out = make_sharded_tensors_for_checkpoint(
            rest, prefix, {"bias": 0} if self.partition_dim == 0 else {}, sharded_offsets
        )
        g, key, axis = self.tp2d, f"{prefix}weight", len(sharded_offsets)
        if self.partition_dim == 0:  # column: output rows over x, input columns over y
            rows, cols = (g.x_rank, g.tp_x), (g.y_rank, g.tp_y)
        else:  # row: output rows over y, input columns over x
            rows, cols = (g.y_rank, g.tp_y), (g.x_rank, g.tp_x)
        if self.stride == 2:
            out[key] = self._glu_factory(key, sharded_offsets)
        else:
            out[key] = ShardedTensor.from_rank_offsets(
                key,
                self.weight,
                *sharded_offsets,
                (axis, *rows),
                (axis + 1, *cols),
                replica_id=_replica_id(),
                prepend_axis_num=axis,
            )
        return out

    def _glu_factory(self, key: str, sharded_offsets: tuple) -> Any:
        # The local rows are [gate_r; up_r] for r = x * tp_y + 0 .. tp_y - 1; megatron's global
        # fc1 is [gate (all ranks); up (all ranks)], where this rank's gates are block x of
        # 2 * tp_x rows and its ups block tp_x + x.
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        g, axis = self.tp2d, len(sharded_offsets)

        @torch.no_grad()
        def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[Any]:
            if flattened_range is not None:
                raise ValueError("2D TP checkpoints: flattened optimizer shards are not supported")
            pieces = t.chunk(2 * g.tp_y, dim=0)
            halves = (torch.cat(pieces[0::2]), torch.cat(pieces[1::2]))
            return [
                ShardedTensor.from_rank_offsets(
                    key,
                    half,
                    *sharded_offsets,
                    (axis, g.x_rank + i * g.tp_x, 2 * g.tp_x),
                    (axis + 1, g.y_rank, g.tp_y),
                    replica_id=replica_id,
                    prepend_axis_num=axis,
                )
                for i, half in enumerate(halves)
            ]

        def merge(parts: list[torch.Tensor]) -> torch.Tensor:
            gate, up = (part.chunk(g.tp_y, dim=0) for part in parts)
            return torch.cat([piece for pair in zip(gate, up) for piece in pair])

        return ShardedTensorFactory(key, self.weight, build, merge, _replica_id())

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.shape != self.weight.shape:
            state_dict[key] = self.weight_from_1d(value.to(self.weight.dtype))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _replica_id() -> tuple[int, int, int]:
    # As megatron's TP-sharded tensors: one copy per data-parallel (and context-parallel) rank.
    from megatron.core import parallel_state as ps

    return (0, 0, ps.get_data_parallel_rank(with_context_parallel=True))


def _mlp_sharded_state_dict(mlp: Any, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
    """megatron's ``MLP.sharded_state_dict`` without its SwiGLU factory around the 2D fc1 weight
    (the factory assumes a 1D shard; it still serves fc1's 1D-sharded bias)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import sharded_state_dict_default

    out: dict[str, Any] = {}
    for name, module in mlp._modules.items():
        sub = sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
        bias = f"{prefix}{name}.bias"
        if mlp.config.gated_linear_unit and name == "linear_fc1" and bias in sub:
            sub[bias] = apply_swiglu_sharded_factory(sub[bias], sharded_offsets)
        out.update(sub)
    return out


class _GatheredLinear(torch.autograd.Function):
    """``all_gather(x, dim, group) @ w^T`` keeping only the local ``x`` for the backward, which
    gathers it again (as megatron's sequence-parallel linears do): the gathered input, ``tp_x``
    (column: the sequence) or ``tp_y`` (row: the features) times the local one, lives only
    inside the forward and the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, dim, group), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        total = _gather(x, ctx.dim, ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        grad_input = _reduce_scatter(grad.matmul(weight), ctx.dim, ctx.group)
        return grad_input, grad_weight, None, None


class Tp2dColumnParallelLinear(_Tp2dLinear):
    """megatron's ``ColumnParallelLinear`` on a ``tp_x x tp_y`` grid (same constructor and forward).

    Input ``[s / tp_x, b, h / tp_y]``; output ``[s, b, out / tp]``, this rank's 1D columns.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        tp_group: Any = None,
        tp_x: int = 1,
        tp_y: int = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        if gather_output or is_expert:
            raise ValueError("Tp2dColumnParallelLinear: gather_output and experts are not 2D; use megatron's linear")
        self.tp2d = build_tp2d_groups(_tp_group(tp_group), tp_x, tp_y)
        self.stride, self.skip_bias_add, self.config = stride, skip_bias_add, config
        full = _full_weight(config, init_method, output_size, input_size)
        self.weight = nn.Parameter(column_block(full, self.tp2d, stride))
        _mark(self.weight)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size // self.tp2d.tp, dtype=config.params_dtype))
            self.bias.tensor_model_parallel, self.bias.partition_dim, self.bias.partition_stride = True, 0, stride

    def forward(self, input_: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, Any]:
        g = self.tp2d
        output = reduce_scatter_along(_GatheredLinear.apply(input_, self.weight, 0, g.x_group), -1, g.y_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None


class Tp2dRowParallelLinear(_Tp2dLinear):
    """megatron's ``RowParallelLinear`` on a ``tp_x x tp_y`` grid (same constructor and forward).

    Input ``[s, b, in / tp]`` (this rank's 1D input columns); output ``[s / tp_x, b, h / tp_y]``.
    """

    partition_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        tp_group: Any = None,
        tp_x: int = 1,
        tp_y: int = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        if not input_is_parallel or is_expert:
            raise ValueError("Tp2dRowParallelLinear: only parallel inputs of dense layers; use megatron's linear")
        self.tp2d = build_tp2d_groups(_tp_group(tp_group), tp_x, tp_y)
        self.skip_bias_add, self.config = skip_bias_add, config
        full = _full_weight(config, init_method, output_size, input_size)
        self.weight = nn.Parameter(row_block(full, self.tp2d))
        _mark(self.weight)
        # Whole on every rank as in 1D TP (same checkpoint entry); each rank adds its hidden block.
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Any]:
        g = self.tp2d
        output = reduce_scatter_along(_GatheredLinear.apply(input_, self.weight, -1, g.y_group), 0, g.x_group)
        if self.bias is None:
            return output, None
        bias = slice_with_reduced_grad(self.bias, g.y_rank, g.tp_y, g.tp_group)
        return (output, bias) if self.skip_bias_add else (output + bias, None)


class Tp2dNorm(nn.Module):
    """RMSNorm or LayerNorm of ``[s / tp_x, b, h / tp_y]`` blocks: statistics all-reduced along y.

    Computed in fp32 as the registry's reference norms; the weight (and LayerNorm's bias) is
    the whole ``[h]`` on every rank, as megatron's, its gradient summed over the TP group.
    """

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        tp_x: int = 1,
        tp_y: int = 1,
        tp_group: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization {config.normalization!r}: 2D TP has RMSNorm and LayerNorm; use one")
        self.rms, self.eps, self.hidden_size = config.normalization == "RMSNorm", eps, hidden_size
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.tp2d = build_tp2d_groups(_tp_group(tp_group), tp_x, tp_y)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.tp2d
        weight = slice_with_reduced_grad(self.weight, g.y_rank, g.tp_y, g.tp_group).float()
        if self.zero_centered:
            weight = weight + 1
        x32 = x.float()
        if self.rms:
            square = all_reduce_along(x32.pow(2).sum(dim=-1, keepdim=True), g.y_group)
            y = x32 * torch.rsqrt(square / self.hidden_size + self.eps) * weight
        else:
            mean = all_reduce_along(x32.sum(dim=-1, keepdim=True), g.y_group) / self.hidden_size
            centred = x32 - mean
            var = all_reduce_along(centred.pow(2).sum(dim=-1, keepdim=True), g.y_group) / self.hidden_size
            y = centred * torch.rsqrt(var + self.eps) * weight
            y = y + slice_with_reduced_grad(self.bias, g.y_rank, g.tp_y, g.tp_group).float()
        return y.to(x.dtype)


def apply_tp2d(spec: ModuleSpec, tp_x: int, tp_y: int) -> ModuleSpec:
    """Put the 2D linears and norms into a dense GPT layer spec (in place; returned).

    Raises:
        ValueError: the layer's MLP has experts, or its linears are not megatron's plain ones
            (another feature replaced them).
    """
    params = {"tp_x": tp_x, "tp_y": tp_y}
    sub = spec.submodules
    attn, mlp = sub.self_attention.submodules, sub.mlp.submodules
    if not hasattr(mlp, "linear_fc1"):
        raise ValueError("2D tensor parallelism covers dense MLPs; this layer has experts (turn tp_2d off for MoE)")
    pairs = [(attn, "linear_qkv", ColumnParallelLinear), (attn, "linear_proj", RowParallelLinear)]
    pairs += [(mlp, "linear_fc1", ColumnParallelLinear), (mlp, "linear_fc2", RowParallelLinear)]
    for owner, name, expected in pairs:
        if getattr(owner, name) is not expected:
            raise ValueError(f"2D tensor parallelism replaces megatron's {name}; it is {getattr(owner, name)!r}")
    attn.linear_qkv = ModuleSpec(module=Tp2dColumnParallelLinear, params=params)
    attn.linear_proj = ModuleSpec(module=Tp2dRowParallelLinear, params=params)
    mlp.linear_fc1 = ModuleSpec(module=Tp2dColumnParallelLinear, params=params)
    mlp.linear_fc2 = ModuleSpec(module=Tp2dRowParallelLinear, params=params)
    sub.input_layernorm = sub.pre_mlp_layernorm = ModuleSpec(module=Tp2dNorm, params=params)
    return spec


def _groups_of(module: nn.Module) -> Tp2dGroups | None:
    for child in module.modules():
        if isinstance(child, (Tp2dColumnParallelLinear, Tp2dRowParallelLinear)):
            return child.tp2d
    return None


def _enter_hook(groups: Tp2dGroups, sequence_parallel: bool) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = enter_2d(kwargs["hidden_states"], groups, sequence_parallel)
        else:
            args = (enter_2d(args[0], groups, sequence_parallel), *args[1:])
        return args, kwargs

    return hook


def _exit_hook(groups: Tp2dGroups, sequence_parallel: bool) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if isinstance(output, tuple):
            return (exit_2d(output[0], groups, sequence_parallel), *output[1:])
        return exit_2d(output, groups, sequence_parallel)

    return hook


def install_tp2d_boundaries(chunks: Iterable[nn.Module]) -> int:
    """Enter the 2D layout at each chunk's first decoder layer and leave it after its last (and
    give each 2D MLP its fc1's checkpoint layout); call it on every model built with :func:`apply_tp2d`.

    Outside the layers the hidden states are megatron's: ``[s, b, h]`` on every TP rank, or
    ``[s / tp, b, h]`` when the chunk's config has ``sequence_parallel``.

    Idempotent; chunks without 2D layers are left alone. Returns the number of chunks changed.
    """
    changed = 0
    for chunk in chunks:
        gpt = chunk
        while hasattr(gpt, "module"):
            gpt = gpt.module
        layers = getattr(getattr(gpt, "decoder", None), "layers", None)
        if not layers or getattr(gpt, "_tp2d_boundaries", False):
            continue
        groups = _groups_of(layers[0])
        if groups is None:
            continue
        # With megatron's sequence parallelism the chunk's input and output are [s / tp, b, h]
        # (embedding, final norm, output layer and pipeline messages as megatron's SP).
        sequence_parallel = bool(getattr(gpt.config, "sequence_parallel", False))
        layers[0].register_forward_pre_hook(_enter_hook(groups, sequence_parallel), with_kwargs=True)
        layers[-1].register_forward_hook(_exit_hook(groups, sequence_parallel), with_kwargs=True)
        for module in gpt.modules():
            # The spec keeps megatron's MLP class (its TransformerLayer passes the TP group only
            # to that class); each 2D MLP instance gets the checkpoint layout of its 2D fc1.
            if isinstance(module, MLP) and isinstance(module.linear_fc1, Tp2dColumnParallelLinear):
                module.sharded_state_dict = types.MethodType(_mlp_sharded_state_dict, module)
        gpt._tp2d_boundaries = True
        changed += 1
    return changed


def _linears(chunks: Iterable[nn.Module]) -> Iterable[tuple[str, nn.Module]]:
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, (Tp2dColumnParallelLinear, Tp2dRowParallelLinear)):
                yield name, module


def tp2d_to_1d_state(chunks: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's ``state_dict`` tensors of the chunks in the 1D TP layout (collective over TP).

    The keys are the chunks' own; TP rank ``r = x * tp_y + y`` gets the tensors 1D TP rank ``r``
    holds (only the 2D linears' weights differ from ``state_dict``), so a 1D writer saves it as is.
    """
    chunks = list(chunks)
    state = {
        k: v.detach().clone()
        for chunk in chunks
        for k, v in chunk.state_dict(keep_vars=False).items()
        if isinstance(v, torch.Tensor)
    }
    for name, module in _linears(chunks):
        state[f"{name}.weight"] = module.weight_1d()
    return state


def load_1d_state_into_tp2d(chunks: Iterable[nn.Module], state: Mapping[str, torch.Tensor]) -> None:
    """Load TP rank ``r``'s 1D state (a 1D model's ``state_dict`` tensors) into 2D chunks (collective over TP).

    ``load_state_dict`` does the conversion (the 2D linears accept 1D weights); this checks
    that every tensor of the chunks is in ``state``.

    Raises:
        KeyError: a parameter or buffer of the chunks is missing from ``state``.
    """
    for chunk in chunks:
        own = [k for k, v in chunk.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)]
        missing = [k for k in own if k not in state]
        if missing:
            raise KeyError(f"not in the 1D state: {missing[:4]}; save it from a model of the same shape and layers")
        chunk.load_state_dict({k: state[k] for k in own}, strict=False)
