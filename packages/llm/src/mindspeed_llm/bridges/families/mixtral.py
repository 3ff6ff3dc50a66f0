"""Mixtral (``MixtralForCausalLM``): Mistral attention, every layer a softmax-routed MoE."""

from __future__ import annotations

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, register_bridge
from mindspeed_llm.bridges.common import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    moe_rules,
)


@register_bridge
class MixtralBridge(Bridge):
    """Mixtral 8x7B / 8x22B. The router's top-k softmax equals megatron's default routing
    (softmax over the top-k logits), so no router option needs translating."""

    family = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    hf_model_type = "mixtral"
    config_keys = (
        *LLAMA_CONFIG_KEYS,
        ConfigKey("num_experts", "num_local_experts"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_ffn_hidden_size", "intermediate_size"),
    )
    requires = LLAMA_REQUIRES
    capabilities = Capabilities(moe=True)
    rules = (
        *EMBEDDING_RULES,
        *ATTENTION_RULES,
        *moe_rules(HF + "block_sparse_moe.", router="gate", gate="w1", up="w3", down="w2"),
    )
