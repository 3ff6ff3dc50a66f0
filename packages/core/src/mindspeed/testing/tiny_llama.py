"""A single-device Llama built from the kernel registry, for tests and the demo.

It exists to prove that the registry's kernels compose into a real model: with the same
weights its logits equal ``transformers.LlamaForCausalLM``'s (tests/core/testing). Parameter
names follow Hugging Face's so state dicts load into either model.
"""

from __future__ import annotations

import torch
from torch import nn

from mindspeed.model.shape import ModelShape
from mindspeed.ops import resolve_kernel
from mindspeed.ops.rotary import rotary_cos_sin


class _Norm(nn.Module):
    def __init__(self, hidden: int, eps: float, impl: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.kernel = resolve_kernel("rms_norm", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelShape, impl: str, sliding_window: int | None) -> None:
        super().__init__()
        d, nq, nkv = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
        self.nq, self.nkv, self.d = nq, nkv, d
        self.q_proj = nn.Linear(cfg.hidden_size, nq * d, bias=cfg.add_qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * d, bias=cfg.add_qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * d, bias=cfg.add_qkv_bias)
        self.o_proj = nn.Linear(nq * d, cfg.hidden_size, bias=False)
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        self.rope = resolve_kernel("rotary_pos_emb", impl)
        self.attn = resolve_kernel("attention", impl, features=("window",) if sliding_window else ())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nq, self.d)
        k = self.k_proj(x).view(b, s, self.nkv, self.d)
        v = self.v_proj(x).view(b, s, self.nkv, self.d)
        # cos/sin are [s, d]; a head axis makes them broadcast over [b, s, n, d].
        q = self.rope(q, cos[:, None, :], sin[:, None, :])
        k = self.rope(k, cos[:, None, :], sin[:, None, :])
        out = self.attn(q, k, v, causal=True, window_size=self.window)
        return self.o_proj(out.reshape(b, s, self.nq * self.d))


class _Mlp(nn.Module):
    def __init__(self, cfg: ModelShape, impl: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.swiglu = resolve_kernel("swiglu", impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelShape, impl: str, sliding_window: int | None) -> None:
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.norm_epsilon, impl)
        self.self_attn = _Attention(cfg, impl, sliding_window)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.norm_epsilon, impl)
        self.mlp = _Mlp(cfg, impl)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: ModelShape, impl: str, sliding_window: int | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg, impl, sliding_window) for _ in range(cfg.num_layers))
        self.norm = _Norm(cfg.hidden_size, cfg.norm_epsilon, impl)


class TinyLlama(nn.Module):
    """Llama decoder (RMSNorm, RoPE, GQA attention, SwiGLU) on registry kernels.

    Args:
        cfg: the shape (a dense Llama-like :class:`~mindspeed.model.ModelShape`; ``add_qkv_bias``
            gives q/k/v biases).
        impl: kernel choice for every op ("auto", "reference", or a backend name).
        sliding_window: attend to this many most recent tokens (a run setting; default: all).
    """

    def __init__(self, cfg: ModelShape, impl: str = "auto", sliding_window: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg, impl, sliding_window)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) weights, ones for norms, zeros for biases (as HF initialises Llama)."""
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, std=std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]``."""
        cos, sin = rotary_cos_sin(
            input_ids.shape[1], self.cfg.kv_channels, base=self.cfg.rotary_base, device=input_ids.device
        )
        x = self.model.embed_tokens(input_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))
