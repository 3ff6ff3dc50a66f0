"""DeepSeek's multi-latent attention (MLA) for the inference decoder, caching the compressed latent.

MLA projects each token to a small latent ``c`` (``kv_lora_rank`` wide, RMS-normalised) plus one
rotary key ``k_rope`` shared by all heads; per head, keys are ``[W_uk c; k_rope]`` and values
``W_uv c``. Folding ``W_uk`` into the query (``q_lat = q_nope W_uk``, so ``q_lat . c = q_nope .
W_uk c``) and ``W_uv`` into the output (``out = (sum_j p_j c_j) W_uv``) turns it into multi-query
attention over one key/value head of width ``kv_lora_rank + rope_dim``: key ``[c; k_rope]``,
value ``c``. That is what the cache stores (:class:`~mindspeed_llm.inference.cache.KVCache` with
one kv head): ``kv_lora_rank + rope_dim`` channels per token and layer (576 for DeepSeek-V3),
where the expanded keys and values would take ``heads * (qk_head_dim + rope_dim + v_head_dim)``
(40,960 for DeepSeek-V3), about 70 times more; and it reaches the registry attention kernel and
the cache's masking unchanged, as the grouped layout ``[kv_heads=1, group=heads + 1, dim]``
(queries, then the key). The value is the latent zero-padded to the key's width, and the
output is cut back (exact). The price: every head attends at the latent width, which costs more
than the expanded form when many tokens attend at once (prefill); decode, which is bound by
reading the cache, gains.

Weights stay under megatron's names and layouts (``linear_kv_up_proj`` rows per head
``[k_nope; v]``, ``linear_kv_down_proj`` rows ``[latent; k_rope]``), as the bridge loads them.
The rotary channels come interleaved (DeepSeek's ``rope_interleave``): they are de-interleaved
before the registry's rotate-half kernel, as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mindspeed_llm.bridges import ModelShape
from mindspeed_llm.inference.cache import AttentionStep


def mla_cache_width(shape: ModelShape) -> int:
    """Channels cached per token and layer: the latent and the rotary key."""
    return int(shape.kv_lora_rank) + int(shape.qk_pos_emb_head_dim)


def mla_softmax_scale(shape: ModelShape) -> float:
    """``1 / sqrt(qk_head_dim + rope_dim)``, times YaRN's ``mscale(factor, mscale_all_dim)^2``
    (DeepSeek's, transformers' and megatron's formula)."""
    scale = 1.0 / math.sqrt(int(shape.qk_head_dim) + int(shape.qk_pos_emb_head_dim))
    factor = float(shape.rotary_scaling_factor)
    if shape.rope_type == "yarn" and shape.mscale_all_dim and factor > 1:
        mscale = 0.1 * float(shape.mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention:
    """One layer's MLA weights (megatron names) and its attention, through an :class:`AttentionStep`.

    Args:
        model: the decoder (its ``rms_norm`` and ``rotary`` kernels, ``spec`` and ``dtype``).
        get: megatron name inside the layer -> tensor (``None`` when absent).
    """

    def __init__(self, model: Any, get: Any) -> None:
        shape: ModelShape = model.spec.shape
        self.model = model
        self.heads, self.latent = shape.num_attention_heads, int(shape.kv_lora_rank)
        self.nope, self.rope, self.v_dim = int(shape.qk_head_dim), int(shape.qk_pos_emb_head_dim), int(shape.v_head_dim)
        self.q_proj = get("self_attention.linear_q_proj.weight")
        self.q_down = get("self_attention.linear_q_down_proj.weight")
        self.q_norm = get("self_attention.q_layernorm.weight")
        self.q_up = get("self_attention.linear_q_up_proj.weight")
        self.kv_down = get("self_attention.linear_kv_down_proj.weight")
        self.kv_norm = get("self_attention.kv_layernorm.weight")
        self.kv_up = get("self_attention.linear_kv_up_proj.weight")
        self.proj = get("self_attention.linear_proj.weight")
        # interleaved pairs (0, 1), (2, 3) ... -> halves [0, 2, ...; 1, 3, ...], as rotate-half expects
        self.deinterleave = torch.cat((torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2))).to(model.device)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, step: AttentionStep
    ) -> torch.Tensor:
        """The attention block's output ``[tokens, hidden]`` for normed inputs ``h`` ``[tokens, hidden]``
        (``cos``/``sin`` ``[tokens, 1, 1, rope_dim]``)."""
        m, eps = self.model, self.model.spec.norm_eps
        tokens = h.shape[0]
        if self.q_down is not None:
            q = F.linear(m.rms_norm(F.linear(h, self.q_down), self.q_norm, eps), self.q_up)
        else:
            q = F.linear(h, self.q_proj)
        q = q.view(tokens, self.heads, self.nope + self.rope)
        q_nope, q_rope = q.split((self.nope, self.rope), dim=-1)
        latent, k_rope = F.linear(h, self.kv_down).split((self.latent, self.rope), dim=-1)
        latent = m.rms_norm(latent, self.kv_norm, eps)
        up = self.kv_up.view(self.heads, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = up[:, : self.nope], up[:, self.nope :]
        # [tokens, 1, heads + 1, rope]: every head's query rope and the shared key rope, rotated in one call.
        rope = torch.cat((q_rope, k_rope[:, None]), dim=1)[..., self.deinterleave].unsqueeze(1)
        rope = m.rotary(rope, cos, sin)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        queries = torch.cat((q_latent, rope[:, 0, : self.heads]), dim=-1)
        key = torch.cat((latent, rope[:, 0, self.heads]), dim=-1)
        qk = torch.cat((queries, key[:, None]), dim=1).unsqueeze(1)  # [tokens, 1, heads + 1, latent + rope]
        value = torch.constant_pad_nd(latent, (0, self.rope)).unsqueeze(1)  # [tokens, 1, latent + rope]
        out = step.attend(layer, qk, value).view(tokens, self.heads, self.latent + self.rope)[..., : self.latent]
        out = torch.einsum("thl,hvl->thv", out, w_uv).reshape(tokens, self.heads * self.v_dim)
        return F.linear(out, self.proj)
