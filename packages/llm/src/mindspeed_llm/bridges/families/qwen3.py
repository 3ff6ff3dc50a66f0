"""Qwen3 dense (``Qwen3ForCausalLM``): Llama's layers plus per-head RMSNorm of queries and keys."""

from __future__ import annotations

from mindspeed_llm.bridges.base import Bridge, register_bridge
from mindspeed_llm.bridges.common import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    MG,
    QK_NORM_RULES,
    gated_mlp_rules,
)


@register_bridge
class Qwen3Bridge(Bridge):
    """Qwen3 0.6B to 32B."""

    family = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_model_type = "qwen3"
    config_keys = LLAMA_CONFIG_KEYS
    constants = {"qk_layernorm": True}
    # attention_bias would add an o_proj bias too, which megatron's local layer lacks.
    requires = (*LLAMA_REQUIRES, ("attention_bias", False))
    rules = (*EMBEDDING_RULES, *ATTENTION_RULES, *QK_NORM_RULES, *gated_mlp_rules(MG + "mlp.", HF + "mlp."))
