"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (QK norm), routed experts, optional dense layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, register_bridge
from mindspeed_llm.bridges.common import (
    ATTENTION_RULES,
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    MG,
    QK_NORM_RULES,
    gated_mlp_rules,
    moe_rules,
)
from mindspeed_llm.bridges.shape import ModelShape


@register_bridge
class Qwen3MoeBridge(Bridge):
    """Qwen3-30B-A3B / 235B-A22B. Layers in ``mlp_only_layers`` (or off the ``decoder_sparse_step``
    grid) keep a dense MLP; megatron's ``moe_layer_freq`` list says the same."""

    family = "qwen3-moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_model_type = "qwen3_moe"
    config_keys = (
        *LLAMA_CONFIG_KEYS,
        ConfigKey("num_experts", "num_local_experts"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size"),
        # Without renormalisation the top-k weights are slices of the softmax over all experts.
        ConfigKey("moe_router_pre_softmax", "norm_topk_prob", default=False, negate=True),
    )
    constants = {"qk_layernorm": True}
    requires = (*LLAMA_REQUIRES, ("attention_bias", False))
    capabilities = Capabilities(moe=True)
    rules = (
        *EMBEDDING_RULES,
        *ATTENTION_RULES,
        *QK_NORM_RULES,
        *gated_mlp_rules(MG + "mlp.", HF + "mlp.", layers="dense"),
        *moe_rules(HF + "mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj"),
    )

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step") or 1
        return {
            "moe_layer_freq": tuple(
                int(i not in dense and (i + 1) % step == 0) for i in range(config["num_hidden_layers"])
            )
        }

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        return {
            "mlp_only_layers": [i for i, moe in enumerate(shape.moe_layer_freq) if not moe],
            "decoder_sparse_step": 1,
        }
