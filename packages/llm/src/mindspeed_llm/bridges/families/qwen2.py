"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's layers plus q/k/v biases."""

from __future__ import annotations

from mindspeed_llm.bridges.base import Bridge, register_bridge
from mindspeed_llm.bridges.common import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    MG,
    QKV_BIAS_RULES,
    gated_mlp_rules,
)


@register_bridge
class Qwen2Bridge(Bridge):
    """Qwen2 and Qwen2.5 (small sizes tie the output layer to the embedding)."""

    family = "qwen25"
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_model_type = "qwen2"
    config_keys = LLAMA_CONFIG_KEYS
    # Qwen2 always has q/k/v biases and never an o_proj bias: megatron's add_qkv_bias exactly.
    constants = {"add_qkv_bias": True}
    requires = LLAMA_REQUIRES
    rules = (*EMBEDDING_RULES, *ATTENTION_RULES, *QKV_BIAS_RULES, *gated_mlp_rules(MG + "mlp.", HF + "mlp."))
