"""Llama 2 / 3.x (``LlamaForCausalLM``): grouped-query attention, SwiGLU, RMSNorm, no biases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, register_bridge
from mindspeed_llm.bridges.common import ATTENTION_RULES, EMBEDDING_RULES, HF, LLAMA_CONFIG_KEYS, MG, gated_mlp_rules
from mindspeed_llm.bridges.shape import ModelShape

#: Llama 3.1's rope scaling as megatron-core implements it (only the factor is a parameter).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@register_bridge
class LlamaBridge(Bridge):
    """Llama: the reference dense family the others are written against."""

    family = "llama2"
    hf_architectures = ("LlamaForCausalLM",)
    hf_model_type = "llama"
    config_keys = LLAMA_CONFIG_KEYS
    # o_proj and MLP biases have no place in megatron's bias-free local layer.
    requires = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
    rules = (*EMBEDDING_RULES, *ATTENTION_RULES, *gated_mlp_rules(MG + "mlp.", HF + "mlp."))

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        rope = config.get("rope_parameters") or {}
        kind = rope.get("rope_type", "default")
        if kind == "default":
            return {}
        fixed = {key: rope.get(key) for key in _LLAMA3_ROPE}
        if kind != "llama3" or fixed != _LLAMA3_ROPE:
            raise ValueError(
                f"config.json's rope_parameters {rope} are not supported: megatron-core implements "
                f"rope_type 'default' and 'llama3' with {_LLAMA3_ROPE}"
            )
        return {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        if not shape.use_rope_scaling:
            return {}
        return {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": shape.rotary_base,
                "factor": shape.rope_scaling_factor,
                **_LLAMA3_ROPE,
            }
        }
