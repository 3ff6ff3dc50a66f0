"""What the inference decoder needs to know about a model, read once from its bridge and config.

:class:`DecoderSpec` is built from the family's :class:`~mindspeed_llm.bridges.ModelShape` (sizes,
attention variant, MoE layout: the same value convert-ckpt plans with) and the transformers config
(rotary frequencies, sliding windows, stop tokens), and refuses what the decoder does not
implement with a message naming the supported families.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_llm.bridges import Bridge, ModelShape, families_with, require_capability
from mindspeed_llm.inference.mla import mla_cache_width, mla_softmax_scale

#: Families the decoder runs (MindSpeed-LLM's ``--model-type-hf`` names): those whose bridge
#: declares ``infers``.
SUPPORTED_FAMILIES = families_with("infers")


@dataclass(frozen=True)
class DecoderSpec:
    """Sizes and variants of a Llama-like decoder, as the inference model runs it.

    Attributes:
        family: the bridge family.
        shape: the megatron shape (parameter names and sizes come from it).
        num_layers: decoder layers.
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (query groups); 1 with multi-latent attention (the latent
            is one key/value head shared by every query head, :mod:`.mla`).
        head_dim: width of one head (with MLA: of the cached latent and rotary key).
        vocab_size: embedding rows.
        norm_eps: RMSNorm epsilon.
        inv_freq: rotary inverse frequencies ``[rotary dim / 2]`` (fp32; the rotary dim is
            ``shape.rotary_dim`` (``head_dim`` unless the rotary is partial), or MLA's
            ``qk_pos_emb_head_dim``).
        rope_scale: factor on cos/sin (transformers' ``attention_scaling``; 1 for default and llama3).
        windows: per layer, the sliding window in tokens (``None``: full causal attention).
        moe_layers: per layer, whether its MLP is routed experts.
        softmax_scale: the attention's score scale (``1 / sqrt(head_dim)``; MLA's own, :mod:`.mla`;
            Gemma's ``query_pre_attn_scalar ** -0.5``).
        local_inv_freq: inverse frequencies of the sliding-window layers when they rotate with
            their own base (Gemma 3's ``rope_parameters['sliding_attention']``; ``None``: every
            layer uses ``inv_freq``).
        local_rope_scale: their cos/sin factor.
    """

    family: str
    shape: ModelShape
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    inv_freq: torch.Tensor
    rope_scale: float
    windows: tuple[int | None, ...]
    moe_layers: tuple[bool, ...]
    softmax_scale: float
    local_inv_freq: torch.Tensor | None = None
    local_rope_scale: float = 1.0

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it rotates with ``local_inv_freq``."""
        if self.local_inv_freq is None:
            return (False,) * self.num_layers
        return tuple(self.shape.is_window_layer(i) for i in range(self.num_layers))

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def tie_embeddings(self) -> bool:
        """The output layer is the embedding."""
        return self.shape.tie_embeddings


def check_supported(bridge: Bridge, shape: ModelShape) -> None:
    """Raise ``ValueError`` for a model the decoder does not implement: its bridge does not declare ``infers``.

    Raises:
        ValueError: naming the family, what it is made of (MLA, shared experts ...) and the
            supported families.
    """
    del shape  # what a family is made of is its bridge's declaration
    require_capability(bridge, "infers")


#: The layer types of models whose ``rope_parameters`` are given per layer type (Gemma 3).
GLOBAL_LAYERS, LOCAL_LAYERS = "full_attention", "sliding_attention"


def rotary_frequencies(config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the model's rotary embedding, as transformers computes them.

    Args:
        config: the transformers config (``rope_parameters`` decides the variant).
        head_dim: channels that rotate (a head's width, or its rotary part).
        layer_type: the entry of ``rope_parameters`` given per layer type (``None``: not so given).

    Returns:
        ``(inv_freq [head_dim / 2] fp32, scale)``.
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    kind = params.get("rope_type", "default")
    if kind == "default":
        base = float(params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"config.json's rope_type {kind!r} is not supported; use one of default, "
            f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
        )
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scale)


def sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the sliding window of its attention (``None``: full), following transformers.

    Models with ``layer_types`` (Qwen2/3) window the ``sliding_attention`` layers; models without
    (Mistral, Mixtral) window every layer when ``sliding_window`` is set.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return (None,) * num_layers
    if types:
        return tuple(int(window) if kind == "sliding_attention" else None for kind in types[:num_layers])
    return (int(window),) * num_layers


def build_spec(bridge: Bridge, shape: ModelShape, config: Any) -> DecoderSpec:
    """The :class:`DecoderSpec` of a model.

    Args:
        bridge: the family's bridge.
        shape: the megatron shape (from the checkpoint or ``bridge.shape_from_hf``).
        config: the transformers config of the model.

    Raises:
        ValueError: the model uses something the decoder does not implement.
    """
    check_supported(bridge, shape)
    mla = shape.multi_latent_attention
    # Partial rotary (GLM-4.5): only the first rotary_dim channels of a head rotate; the rotary
    # kernel rotates as many channels as the cos/sin tables are wide and passes the rest.
    rotary_dim = shape.qk_pos_emb_head_dim if mla else shape.rotary_dim
    per_type = isinstance((getattr(config, "rope_parameters", None) or {}).get(GLOBAL_LAYERS), Mapping)
    inv_freq, scale = rotary_frequencies(config, rotary_dim, GLOBAL_LAYERS if per_type else None)
    local_inv_freq, local_scale = rotary_frequencies(config, rotary_dim, LOCAL_LAYERS) if per_type else (None, 1.0)
    moe = tuple(shape.is_moe_layer(i) for i in range(shape.num_layers))
    head_dim = mla_cache_width(shape) if mla else shape.kv_channels
    return DecoderSpec(
        family=bridge.family,
        shape=shape,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_attention_heads,
        num_kv_heads=1 if mla else shape.num_query_groups,
        head_dim=head_dim,
        vocab_size=shape.vocab_size,
        norm_eps=float(shape.norm_epsilon),
        inv_freq=inv_freq,
        rope_scale=scale,
        windows=sliding_windows(config, shape.num_layers),
        moe_layers=moe,
        softmax_scale=mla_softmax_scale(shape) if mla else shape.softmax_scale or 1.0 / math.sqrt(head_dim),
        local_inv_freq=local_inv_freq,
        local_rope_scale=local_scale,
    )


def stop_token_ids(generation_config: Mapping[str, Any] | None, config: Any, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: ``generation_config.json``'s, else the model config's, else the tokenizer's."""
    for value in ((generation_config or {}).get("eos_token_id"), getattr(config, "eos_token_id", None)):
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return (int(tokenizer.eos_token_id),)
    return ()
