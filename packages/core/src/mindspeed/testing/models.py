"""Tiny model presets, built in code so no test or demo downloads a model.

Each preset is a :class:`~mindspeed.model.ModelShape` (the one model description) registered by
name; :func:`hf_llama_kwargs` writes one as ``transformers.LlamaConfig`` arguments, so a preset
runs as :class:`~mindspeed.testing.tiny_llama.TinyLlama` and as transformers' Llama alike. The
LLM suite's bridged families have their own tiny configs (``mindspeed_llm.testing.tiny_models``).
"""

from __future__ import annotations

from typing import Any

from mindspeed.model.shape import ModelShape
from mindspeed.registry import Registry

#: The Llama-like default of the presets: untied, RMSNorm 1e-6, rope base 10000, no biases.
_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    ffn_hidden_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=256,
)


def tiny_shape(**changes: Any) -> ModelShape:
    """The tiny Llama shape with some fields changed."""
    return ModelShape(**{**_TINY, **changes})


def hf_llama_kwargs(shape: ModelShape) -> dict[str, Any]:
    """Keyword arguments of ``transformers.LlamaConfig`` for ``shape`` (a dense Llama-like shape)."""
    return dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rotary_base,
        rms_norm_eps=shape.norm_epsilon,
        tie_word_embeddings=shape.tie_embeddings,
        attention_bias=shape.add_qkv_bias,
        hidden_act="silu",
        mlp_bias=False,
        attention_dropout=0.0,
    )


TINY_CONFIGS: Registry[ModelShape] = Registry("tiny model config")
TINY_CONFIGS.register("llama-tiny", tiny_shape())
TINY_CONFIGS.register("llama-tiny-mha", tiny_shape(num_query_groups=4))
TINY_CONFIGS.register("llama-tiny-mqa-tied", tiny_shape(num_query_groups=1, untie_embeddings_and_output_weights=False))
TINY_CONFIGS.register("llama-small", tiny_shape(vocab_size=1024, hidden_size=256, ffn_hidden_size=1024, num_layers=4))
