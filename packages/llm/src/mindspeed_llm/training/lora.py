"""LoRA on megatron-core GPT models, under tensor, sequence and pipeline parallelism.

:func:`apply_lora` turns the target linears of one unwrapped ``GPTModel`` chunk into LoRA
layers in place and freezes everything else; it must run before megatron's
``DistributedDataParallel`` wraps the chunk (DDP allocates gradient buffers only for the
parameters that require a gradient when it is built). Each target keeps its class's behaviour
and its state-dict keys: its class becomes a subclass that adds ``lora_A.default.weight`` /
``lora_B.default.weight`` (peft's names on megatron modules, what MindSpeed-LLM saves and
``convert-ckpt --lora-load`` reads) and the LoRA term to the output::

    y = base(x) + (dropout(x) @ A^T @ B^T) * alpha / r

Tensor-parallel cuts are those of :mod:`mindspeed_llm.checkpoint.lora`: for a column-parallel
base A is replicated and B cut like the weight's rows (``[gate_r; up_r]`` for a gated
``linear_fc1``); for a row-parallel base A is cut like the weight's columns and B replicated.
The only communication is on the rank-``r`` intermediate ``x @ A^T``: a column-parallel layer
copies it into the tensor-parallel region (the backward all-reduces its gradient, so A's
gradient is complete on every rank), a row-parallel layer all-reduces the partial products
(reduce-scatters them along the sequence under sequence parallelism). Under sequence
parallelism the replicated factor sees only this rank's tokens: it carries
``sequence_parallel=True`` so that megatron's ``finalize_model_grads`` sums its gradient over
the tensor-parallel group, as it does for layernorm weights.

Gathering, saving and exporting the factors is in :mod:`mindspeed_llm.training.lora_io`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mindspeed.log import get_logger
from mindspeed.ops.dropout import sparse_dropout
from mindspeed_llm.bridges.layout import split_tensor
from mindspeed_llm.bridges.megatron_params import MegatronParam, Split
from mindspeed_llm.checkpoint.lora import lora_param

logger = get_logger(__name__)

#: Megatron linear module names LoRA can target (MindSpeed-LLM's ``--lora-target-modules``).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: State-dict key of a LoRA factor.
LORA_KEY = re.compile(r"(^|\.)lora_[AB]\.default\.weight$")


@dataclass
class LoraSettings:
    """LoRA / QLoRA hyper-parameters (the ``lora_*`` flags of MindSpeed-LLM).

    Attributes:
        r: rank of the factors (``--lora-r``).
        alpha: scale numerator; the update is multiplied by ``alpha / r`` (``--lora-alpha``).
        dropout: dropout on the LoRA input during training (``--lora-dropout``).
        target_modules: megatron linear names to adapt (``--lora-target-modules``).
        qlora: store the frozen base weights of the adapted linears in NF4 (4 bit).
        qlora_all_linears: with ``qlora``, quantise the other decoder linears of
            :data:`LORA_TARGETS` too (frozen, without LoRA).
        qlora_block_size: NF4 values per absmax block.
        qlora_double_quant: quantise the absmax values to 8 bits as well.
        qlora_impl: ``nf4_dequantize`` kernel (``"auto"``, ``"reference"``, ``"bitsandbytes"``).
        seed: seed of lora_A's initialisation (the same full A on every layout).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    qlora: bool = False
    qlora_all_linears: bool = False
    qlora_block_size: int = 64
    qlora_double_quant: bool = True
    qlora_impl: str = "auto"
    seed: int = 1234

    @property
    def scaling(self) -> float:
        """``alpha / r``."""
        return float(self.alpha) / self.r

    def validate(self) -> None:
        """Raise a ``ValueError`` naming the bad setting and its fix."""
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora_r must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout!r}")
        targets = tuple(self.target_modules)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"lora_target_modules {list(unknown or targets)} unknown; known megatron module "
                f"names: {', '.join(LORA_TARGETS)}"
            )


class _Factor(torch.nn.Module):
    """Holds one LoRA factor as ``weight`` (so the key reads ``lora_A.default.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


class _LoraUpdate(torch.autograd.Function):
    """``output + scaling * partial @ B^T`` in one GEMM (addmm), with rank-r backward GEMMs.

    No separate scaling and sum passes over the ``[tokens, out]`` output, forward or backward.
    The backward computes B's gradient as ``(partial^T @ grad)^T`` and the partial's as
    ``(B^T @ grad^T)^T``: a GEMM whose output has r (8, 16) columns runs 3 to 9 times slower in
    MKL on the host than the same product written with r rows (``g @ B`` of a [512, 4096] gradient:
    2.6 ms against 0.8 ms; ``g^T @ p``: 6.3 ms against 0.7 ms), which is how autograd writes them.
    The gradients are handed on contiguous (copies of r columns): megatron's tensor-parallel
    mappings all-reduce them in place, which a transposed view does not survive.
    """

    @staticmethod
    def forward(
        ctx, output: torch.Tensor, partial: torch.Tensor, b_weight: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        flat_partial = partial.reshape(-1, partial.shape[-1])
        flat = torch.addmm(output.reshape(-1, output.shape[-1]), flat_partial, b_weight.t(), alpha=scaling)
        ctx.save_for_backward(flat_partial, b_weight)
        ctx.scaling, ctx.partial_shape = scaling, partial.shape
        return flat.view(output.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
        flat_partial, b_weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_partial = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_partial = torch.mm(b_weight.t() * ctx.scaling, flat_grad.t()).t().contiguous().view(ctx.partial_shape)
        if ctx.needs_input_grad[2]:
            grad_b = torch.mm(flat_partial.t() * ctx.scaling, flat_grad).t().contiguous()
        return grad, grad_partial, grad_b, None


class LoraLinear:
    """Mixin put in front of megatron's ColumnParallelLinear / RowParallelLinear by :func:`apply_lora`.

    Attributes set by :func:`add_lora`: ``lora_A`` / ``lora_B`` (``ModuleDict`` with one
    ``default`` factor each), ``lora_scaling``, ``lora_dropout_p``, ``lora_row`` (row-parallel
    base), ``lora_glu`` (gated ``linear_fc1``), ``lora_base`` (the base weight as a
    :class:`MegatronParam` with its global name and full shape).
    """

    layer_mixin_order = 0
    #: Set by :func:`lora_disabled`: the layer computes its base output only (peft's ``disable_adapter``).
    lora_off = False

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_off:
            return output, bias
        partial, b_weight = self.lora_partial(input_), self.lora_B["default"].weight
        if output.dtype == b_weight.dtype and partial.shape[:-1] == output.shape[:-1]:
            return _LoraUpdate.apply(output, partial, b_weight, self.lora_scaling), bias
        return output + (F.linear(partial, b_weight) * self.lora_scaling).to(output.dtype), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``dropout(x) @ A^T @ B^T * alpha / r`` for this rank's part of the output."""
        return F.linear(self.lora_partial(x), self.lora_B["default"].weight) * self.lora_scaling

    def lora_partial(self, x: torch.Tensor) -> torch.Tensor:
        """``dropout(x) @ A^T``, communicated as B's input needs it (this rank's tokens and rows)."""
        from megatron.core.tensor_parallel import mappings

        a_weight = self.lora_A["default"].weight
        partial = F.linear(self._lora_dropped(x).to(a_weight.dtype), a_weight)
        group = self.tp_group
        if self.lora_row:
            partial = (
                mappings.reduce_scatter_to_sequence_parallel_region(partial, group=group)
                if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region(partial, group)
            )
        elif self.sequence_parallel:
            partial = mappings.gather_from_sequence_parallel_region(
                partial, tensor_parallel_output_grad=True, group=group
            )
        else:
            partial = mappings.copy_to_tensor_model_parallel_region(partial, group)
        return partial

    def _lora_dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.lora_dropout_p:
            return x
        if self.lora_row or self.sequence_parallel:
            # This rank holds its own slice of x: a mask of its own (megatron's TP-distinct stream).
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return sparse_dropout(x, self.lora_dropout_p)
        # x is the same on every tensor-parallel rank, and so must its mask be (default stream).
        # On the host only the dropped positions are drawn (sparse_dropout: 6 % of a LoRA step
        # went to torch.dropout's per-element Bernoulli draws).
        return sparse_dropout(x, self.lora_dropout_p)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base layer's entries plus the factors with their tensor-parallel axes."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        factors = {
            "lora_A.default.weight": self.lora_A["default"].weight,
            "lora_B.default.weight": self.lora_B["default"].weight,
        }
        axis = {"lora_A.default.weight": 1} if self.lora_row else {"lora_B.default.weight": 0}
        sharded = make_sharded_tensors_for_checkpoint(
            factors,
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if self.lora_glu:
            key = f"{prefix}lora_B.default.weight"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        state.update(sharded)
        return state


@functools.cache
def _layer_class(base: type, mixins: tuple[type, ...]) -> type:
    name = "".join(m.__name__.removesuffix("Linear") for m in mixins) + base.__name__
    return type(name, (*mixins, base), {"megatron_base_class": base, "layer_mixins": mixins})


def add_layer_mixin(module: torch.nn.Module, mixin: type) -> None:
    """Give ``module`` a subclass of its megatron class with ``mixin`` (and any it already has).

    The class is swapped in place, so every reference megatron holds, the parameters and the
    hooks stay as they are; mixins are ordered by ``layer_mixin_order`` (LoRA outermost, so it
    adds its term to whatever the base forward computes, e.g. an NF4 matmul).
    """
    cls = type(module)
    base = getattr(cls, "megatron_base_class", cls)
    mixins = tuple(sorted({*getattr(cls, "layer_mixins", ()), mixin}, key=lambda m: m.layer_mixin_order))
    module.__class__ = _layer_class(base, mixins)


def _global_module_names(model: torch.nn.Module) -> dict[str, str]:
    """Local module name -> name in the unsharded model (global decoder layer numbers)."""
    out = {}
    decoder = getattr(model, "decoder", None)
    for index, layer in enumerate(getattr(decoder, "layers", [])):
        local, full = f"decoder.layers.{index}", f"decoder.layers.{layer.layer_number - 1}"
        for name, _ in layer.named_modules(prefix=local):
            out[name] = full + name[len(local) :]
    return out


def add_lora(module: torch.nn.Module, global_name: str, settings: LoraSettings, glu: bool) -> None:
    """Turn one megatron linear into a LoRA layer (A: kaiming-uniform like peft, B: zeros).

    A is drawn in full from a generator seeded by ``settings.seed`` and the module's global
    name, then cut: the initial adapter is the same on every parallel layout.
    """
    from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes

    row = isinstance(module, RowParallelLinear)
    split = Split.ROW if row else (Split.GLU if glu else Split.COLUMN)
    base = MegatronParam(f"{global_name}.weight", (module.output_size, module.input_size), split)
    tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
    like = next(module.parameters(), None)
    device = like.device if like is not None else torch.device("cpu")
    dtype = module.config.params_dtype
    full_a = torch.empty(settings.r, module.input_size)
    gen = torch.Generator().manual_seed(settings.seed + zlib.crc32(global_name.encode()))
    torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=gen)
    pieces = {}
    for which, full in (("A", full_a), ("B", torch.zeros(module.output_size, settings.r))):
        pieces[which] = split_tensor(lora_param(base, which, settings.r), full, tp)[tp_rank]
    module.lora_A = torch.nn.ModuleDict({"default": _Factor(pieces["A"].to(device, dtype).contiguous())})
    module.lora_B = torch.nn.ModuleDict({"default": _Factor(pieces["B"].to(device, dtype).contiguous())})
    module.lora_scaling, module.lora_dropout_p = settings.scaling, settings.dropout
    module.lora_row, module.lora_glu, module.lora_base = row, glu, base
    sharded, replicated = (module.lora_A, module.lora_B) if row else (module.lora_B, module.lora_A)
    # Megatron's conventions: a TP-cut parameter says so (grad-norm counts it on every rank);
    # a replicated one fed by sequence-parallel tokens has its gradient summed over TP.
    set_tensor_model_parallel_attributes(sharded["default"].weight, True, 1 if row else 0, 1)
    replicated["default"].weight.sequence_parallel = bool(module.sequence_parallel)
    for factor in (module.lora_A, module.lora_B):
        factor["default"].weight.allreduce = True
    add_layer_mixin(module, LoraLinear)


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """Local module name -> LoRA layer of one (unwrapped) chunk."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


@contextlib.contextmanager
def lora_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the block, every LoRA layer of ``chunks`` computes its base output only.

    The base weights are untouched, so the model is the one before LoRA (an RL reference policy
    is the actor with its adapters off: no second copy of the weights). Not reentrant.
    """
    layers = [layer for chunk in chunks for layer in lora_layers(unwrap_model(chunk)).values()]
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


def lora_delta_weight(layer: LoraLinear) -> torch.Tensor:
    """``B @ A * alpha / r`` in float32: this rank's piece of the layer's weight update.

    The pieces line up with the base weight's: a column-parallel (or gated) base has B cut like
    its rows and A whole, a row-parallel base A cut like its columns and B whole.
    """
    a_weight, b_weight = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return (b_weight.detach().float() @ a_weight.detach().float()) * layer.lora_scaling


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Add LoRA to the target linears of one unwrapped ``GPTModel`` chunk and freeze the rest.

    Call it for every chunk after building (and loading the base weights, which QLoRA needs
    first) and before wrapping in ``DistributedDataParallel``. Expert linears (MoE) are left
    frozen without LoRA.

    Args:
        model: a ``GPTModel`` (not wrapped by DDP).
        settings: the LoRA settings.

    Returns:
        The local names of the modules that got LoRA.

    Raises:
        ValueError: bad settings (unknown target: the message lists the known names), a
            DDP-wrapped model, a target matching no linear of the model, or LoRA applied twice.
    """
    settings.validate()
    if settings.qlora:
        raise ValueError(
            "apply_lora leaves the base weights as they are; for LoraSettings(qlora=True) call "
            "mindspeed_llm.training.qlora.apply_qlora"
        )
    if hasattr(model, "module"):
        raise ValueError(
            "apply_lora needs the bare GPTModel chunk: apply LoRA before wrapping it in "
            "Float16Module / DistributedDataParallel (DDP only gives gradient buffers to trainable params)"
        )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if lora_layers(model):
        raise ValueError("this model already has LoRA layers; apply_lora once per chunk")
    names = _global_module_names(model)
    gated = bool(getattr(getattr(model, "config", None), "gated_linear_unit", False))
    wrapped, found, experts = [], set(), 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in settings.target_modules or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        found.add(leaf)
        if module.is_expert:
            experts += 1
            continue
        add_lora(module, names.get(name, name), settings, glu=gated and leaf == "linear_fc1")
        wrapped.append(name)
    missing = [t for t in settings.target_modules if t not in found]
    if missing:
        raise ValueError(
            f"lora_target_modules {missing} match no megatron linear layer of this model; "
            f"known: {', '.join(LORA_TARGETS)}"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(bool(LORA_KEY.search(name)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        f"LoRA r={settings.r} alpha={settings.alpha} on {len(wrapped)} linears "
        f"({', '.join(settings.target_modules)}): {trainable} trainable parameters on this chunk"
        + (f"; {experts} expert linears left frozen" if experts else "")
    )
    return wrapped


def set_lora_factors(model: torch.nn.Module, factors: Mapping[str, torch.Tensor]) -> int:
    """Copy full (unsharded) factors into this rank's LoRA layers, each cut for its rank.

    Args:
        model: one chunk (wrapped or not).
        factors: ``<global module>.lora_A.default.weight`` -> full tensor (as
            :func:`mindspeed_llm.training.lora_io.gather_lora_factors` returns them); modules
            of the chunk that are missing keep their values.

    Returns:
        The number of factors copied.

    Raises:
        ValueError: a factor of the wrong shape.
    """
    copied = 0
    for layer in lora_layers(unwrap_model(model)).values():
        tp, tp_rank = layer.tp_group.size(), layer.tp_group.rank()
        rank = layer.lora_A["default"].weight.shape[0]
        for which, holder in (("A", layer.lora_A), ("B", layer.lora_B)):
            param = lora_param(layer.lora_base, which, rank)
            full = factors.get(param.name)
            if full is None:
                continue
            if tuple(full.shape) != param.shape:
                raise ValueError(f"{param.name}: shape {tuple(full.shape)} does not fit the model ({param.shape})")
            with torch.no_grad():
                holder["default"].weight.copy_(split_tensor(param, full, tp)[tp_rank])
            copied += 1
    return copied


def is_lora_key(key: str) -> bool:
    """Whether a (sharded) state-dict key is a LoRA factor."""
    return bool(LORA_KEY.search(key))


def split_lora_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, lora)`` entries of a flat (sharded) state dict.

    The trainer loads a checkpoint saved without LoRA into a LoRA model with the ``base`` part
    (megatron's ``dist_checkpointing.load`` fails on keys the checkpoint lacks), and saves
    "adapters only" with the ``lora`` part.
    """
    base, lora = {}, {}
    for key, value in state.items():
        (lora if is_lora_key(key) else base)[key] = value
    return base, lora
