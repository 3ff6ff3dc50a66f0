"""Model FLOPs of a decoder-only transformer, counted from its :class:`~mindspeed.model.ModelShape` (for MFU).

Counted are the matrix multiplications of one token, forward, with 2 FLOPs per multiply-add:

- attention projections: ``2 h (q + 2 kv)`` for queries, keys and values (``q`` = heads x head
  dim, ``kv`` = key/value heads x head dim) and ``2 q h`` for the output projection; with
  multi-latent attention the down and up projections of queries and keys/values instead;
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

from mindspeed.model.shape import ModelShape


def _mlp(hidden: int, width: int, gated: bool) -> float:
    return 2.0 * hidden * width * (3 if gated else 2)


def _attention(shape: ModelShape, seq_length: int) -> float:
    h, s, heads = shape.hidden_size, seq_length, shape.num_attention_heads
    if shape.multi_latent_attention:
        qk = shape.qk_head_dim + shape.qk_pos_emb_head_dim
        q_proj = (
            2.0 * h * shape.q_lora_rank + 2.0 * shape.q_lora_rank * heads * qk
            if shape.q_lora_rank
            else 2.0 * h * heads * qk
        )
        kv_proj = 2.0 * h * (shape.kv_lora_rank + shape.qk_pos_emb_head_dim)
        kv_proj += 2.0 * shape.kv_lora_rank * heads * (shape.qk_head_dim + shape.v_head_dim)
        out = 2.0 * heads * shape.v_head_dim * h
        return q_proj + kv_proj + out + 2.0 * s * heads * qk + 2.0 * s * heads * shape.v_head_dim
    q = heads * shape.kv_channels
    kv = shape.num_query_groups * shape.kv_channels
    return 2.0 * h * (q + 2 * kv) + 2.0 * q * h + 4.0 * s * q


def forward_flops_per_token(shape: ModelShape, seq_length: int, vocab_size: int | None = None) -> float:
    """Forward FLOPs of one token (see the module docstring for what is counted).

    Args:
        shape: the model.
        seq_length: tokens per sequence ``s``.
        vocab_size: output-layer rows ``V`` (default ``shape.vocab_size``; pass the padded vocabulary).
    """
    h = shape.hidden_size
    gated = shape.swiglu or shape.geglu
    dense = _mlp(h, shape.ffn_hidden_size, gated)
    moe_layers = shape.num_moe_layers
    moe = 0.0
    if moe_layers:
        shared = shape.moe_shared_expert_intermediate_size or 0
        moe = (
            shape.moe_router_topk * _mlp(h, shape.moe_ffn_hidden_size, gated)
            + 2.0 * h * shape.num_experts
            + (_mlp(h, shared, gated) if shared else 0.0)
            + (2.0 * h if shape.moe_shared_expert_gate else 0.0)
        )
    layers = (
        shape.num_layers * _attention(shape, seq_length) + (shape.num_layers - moe_layers) * dense + moe_layers * moe
    )
    return layers + 2.0 * h * (vocab_size or shape.vocab_size)


def training_flops_per_token(shape: ModelShape, seq_length: int, vocab_size: int | None = None) -> float:
    """Forward plus backward FLOPs of one token: three forwards."""
    return 3.0 * forward_flops_per_token(shape, seq_length, vocab_size)
