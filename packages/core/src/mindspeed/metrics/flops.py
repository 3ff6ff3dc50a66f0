"""Model FLOPs of a decoder-only transformer, counted from its shape (for MFU).

Counted are the matrix multiplications of one token, forward, with 2 FLOPs per multiply-add:

- attention projections: ``2 h (q + 2 kv)`` for queries, keys and values (``q`` = heads x head
  dim, ``kv`` = key/value heads x head dim) and ``2 q h`` for the output projection;
- attention itself: ``2 s q`` for ``Q K^T`` and ``2 s q`` for the weighted values, over the full
  ``s x s`` score matrix (the PaLM convention for MFU: the causal half is not subtracted);
- the MLP: ``2 h f`` per weight matrix, three of them when gated (SwiGLU), two otherwise; MoE
  layers run ``topk`` experts (plus shared experts) and a ``2 h E`` router;
- the output layer ``2 h V``.

Training costs three forwards (the backward computes gradients of activations and of weights).
Recomputation is not counted: this is model FLOPs utilisation (MFU), not hardware FLOPs.
Norms, rotary embeddings, softmax and the loss are left out (a few per mille of the total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOPs of a decoder-only transformer depend on.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width ``h``.
        ffn_hidden_size: dense MLP width ``f``.
        num_attention_heads: query heads.
        num_query_groups: key/value heads.
        kv_channels: head dimension.
        vocab_size: output-layer rows ``V`` (the padded vocabulary).
        seq_length: tokens per sequence ``s``.
        gated_mlp: SwiGLU-style MLP (three matrices).
        num_moe_experts: experts of an MoE layer (``None``: dense).
        moe_router_topk: experts per token.
        moe_ffn_hidden_size: expert MLP width.
        moe_shared_expert_size: shared-expert MLP width (0: none).
        moe_layers: layers that are MoE (default: all when ``num_moe_experts`` is set).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    seq_length: int
    gated_mlp: bool = True
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_size: int = 0
    moe_layers: int | None = None

    @classmethod
    def from_transformer_config(cls, config: Any, vocab_size: int, seq_length: int) -> TransformerShape:
        """The shape of a megatron-core ``TransformerConfig`` (duck-typed) with its vocabulary and sequence length."""
        experts = getattr(config, "num_moe_experts", None)
        freq = getattr(config, "moe_layer_freq", 1)
        moe_layers = None
        if experts:
            moe_layers = sum(freq) if isinstance(freq, (list, tuple)) else len(range(0, config.num_layers, freq))
        return cls(
            num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            kv_channels=config.kv_channels or config.hidden_size // config.num_attention_heads,
            vocab_size=vocab_size, seq_length=seq_length, gated_mlp=bool(config.gated_linear_unit),
            num_moe_experts=experts or None, moe_router_topk=getattr(config, "moe_router_topk", 2),
            moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None),
            moe_shared_expert_size=getattr(config, "moe_shared_expert_intermediate_size", None) or 0,
            moe_layers=moe_layers,
        )


def _mlp(hidden: int, width: int, gated: bool) -> float:
    return 2.0 * hidden * width * (3 if gated else 2)


def forward_flops_per_token(shape: TransformerShape) -> float:
    """Forward FLOPs of one token (see the module docstring for what is counted)."""
    h, s = shape.hidden_size, shape.seq_length
    q = shape.num_attention_heads * shape.kv_channels
    kv = shape.num_query_groups * shape.kv_channels
    attention = 2.0 * h * (q + 2 * kv) + 2.0 * q * h + 4.0 * s * q
    dense = _mlp(h, shape.ffn_hidden_size, shape.gated_mlp)
    moe_layers = 0
    moe = 0.0
    if shape.num_moe_experts:
        moe_layers = shape.num_layers if shape.moe_layers is None else shape.moe_layers
        width = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
        moe = (shape.moe_router_topk * _mlp(h, width, shape.gated_mlp) + 2.0 * h * shape.num_moe_experts
               + (_mlp(h, shape.moe_shared_expert_size, shape.gated_mlp) if shape.moe_shared_expert_size else 0.0))
    layers = shape.num_layers * attention + (shape.num_layers - moe_layers) * dense + moe_layers * moe
    return layers + 2.0 * h * shape.vocab_size


def training_flops_per_token(shape: TransformerShape) -> float:
    """Forward plus backward FLOPs of one token: three forwards."""
    return 3.0 * forward_flops_per_token(shape)
