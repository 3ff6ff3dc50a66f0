"""Tiny model configs, built in code so no test or demo downloads a model.

Each preset is registered by name; the LLM bridges' tests add one preset per model family
(see ``mindspeed_llm``). Fields follow Hugging Face's names so a preset maps one to one onto
a ``transformers`` config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from mindspeed.registry import Registry


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a tiny decoder-only transformer (Llama family by default)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None

    @property
    def head_dim(self) -> int:
        """Per-head width (hidden / heads)."""
        return self.hidden_size // self.num_attention_heads

    def with_(self, **changes: Any) -> TinyModelConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def to_hf_llama_dict(self) -> dict[str, Any]:
        """Keyword arguments of ``transformers.LlamaConfig`` for the same shape."""
        data = asdict(self)
        data.pop("sliding_window")
        data.update(hidden_act="silu", mlp_bias=False, attention_dropout=0.0, head_dim=self.head_dim)
        return data


TINY_CONFIGS: Registry[TinyModelConfig] = Registry("tiny model config")
TINY_CONFIGS.register("llama-tiny", TinyModelConfig())
TINY_CONFIGS.register("llama-tiny-mha", TinyModelConfig(num_key_value_heads=4))
TINY_CONFIGS.register("llama-tiny-mqa-tied", TinyModelConfig(num_key_value_heads=1, tie_word_embeddings=True))
TINY_CONFIGS.register(
    "llama-small", TinyModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
)
