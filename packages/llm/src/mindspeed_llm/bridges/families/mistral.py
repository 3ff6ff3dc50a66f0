"""Mistral (``MistralForCausalLM``): Llama's layers; sliding-window attention is a runtime setting."""

from __future__ import annotations

from mindspeed_llm.bridges.base import Bridge, register_bridge
from mindspeed_llm.bridges.common import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    MG,
    gated_mlp_rules,
)


@register_bridge
class MistralBridge(Bridge):
    """Mistral 7B / Nemo: same weights as Llama."""

    family = "mistral"
    hf_architectures = ("MistralForCausalLM",)
    hf_model_type = "mistral"
    config_keys = LLAMA_CONFIG_KEYS
    requires = LLAMA_REQUIRES
    rules = (*EMBEDDING_RULES, *ATTENTION_RULES, *gated_mlp_rules(MG + "mlp.", HF + "mlp."))
