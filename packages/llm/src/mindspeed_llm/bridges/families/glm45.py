"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``): grouped-query attention with q/k/v biases and an
optional per-head QK norm, partial rotary (the first ``partial_rotary_factor`` of each head's
channels rotate), DeepSeek-V3's MoE (sigmoid scores with a selection bias, expert groups, a shared
expert, the first k layers dense) and its multi-token-prediction layers (``--mtp-num-layers``)."""

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
    QKV_BIAS_RULES,
    gated_mlp_rules,
    moe_rules,
    mtp_rules,
)
from mindspeed_llm.bridges.rules import DropExtraLayers, Rename, only_if
from mindspeed_llm.bridges.shape import ModelShape

#: One decoder layer: attention (biases and QK norm when the config has them), then a dense MLP
#: (first k layers) or routed experts with their selection bias plus the shared experts.
LAYER_RULES = (
    *ATTENTION_RULES,
    *only_if("add_qkv_bias", QKV_BIAS_RULES),
    *only_if("qk_layernorm", QK_NORM_RULES),
    *gated_mlp_rules(MG + "mlp.", HF + "mlp.", layers="dense"),
    *moe_rules(HF + "mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj"),
    Rename(MG + "mlp.router.expert_bias", HF + "mlp.gate.e_score_correction_bias", layers="moe"),
    *gated_mlp_rules(MG + "mlp.shared_experts.", HF + "mlp.shared_experts.", layers="moe"),
)


@register_bridge
class Glm45Bridge(Bridge):
    """GLM-4.5, GLM-4.5-Air, GLM-4.6.

    transformers' router is DeepSeek-V3's: a group's score is the sum of its two best biased
    scores, megatron's the sum of its best ``topk / topk_group``; the two agree for the released
    configs (one group) and whenever ``topk / topk_group`` is 2; other grouped configs are refused.
    """

    family = "glm45-moe"
    hf_architectures = ("Glm4MoeForCausalLM",)
    hf_model_type = "glm4_moe"
    config_keys = (
        *LLAMA_CONFIG_KEYS,
        ConfigKey("add_qkv_bias", "attention_bias", default=False),
        ConfigKey("qk_layernorm", "use_qk_norm", default=False),
        # transformers' Glm4MoeConfig defaults partial_rotary_factor to 0.5 when absent.
        ConfigKey("rotary_percent", "rope_parameters.partial_rotary_factor", default=0.5),
        ConfigKey("num_experts", "n_routed_experts"),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_router_num_groups", "n_group"),
        ConfigKey("moe_router_group_topk", "topk_group"),
        ConfigKey("moe_router_topk_scaling_factor", "routed_scaling_factor"),
    )
    constants = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    # megatron renormalises sigmoid top-k weights always.
    requires = (*LLAMA_REQUIRES, ("norm_topk_prob", True))
    mtp_config_key = "num_nextn_predict_layers"
    capabilities = Capabilities(moe=True, shared_experts=True, mtp=True)
    rules = (*EMBEDDING_RULES, *LAYER_RULES, *mtp_rules(LAYER_RULES), DropExtraLayers())

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        groups, chosen, topk = config.get("n_group") or 1, config.get("topk_group") or 1, config["num_experts_per_tok"]
        if groups > 1 and topk // chosen != 2:
            raise ValueError(
                f"config.json's num_experts_per_tok {topk} / topk_group {chosen} is not 2: transformers scores a "
                f"group by its 2 best experts, megatron by its best num_experts_per_tok / topk_group; use n_group 1"
            )
        dense = config.get("first_k_dense_replace") or 0
        shared = config.get("n_shared_experts") or 0
        if not shared:
            raise ValueError(
                "config.json's n_shared_experts is 0; the glm45-moe bridge needs at least one shared expert"
            )
        return {
            "moe_layer_freq": tuple(int(i >= dense) for i in range(config["num_hidden_layers"])),
            "moe_shared_expert_intermediate_size": shared * config["moe_intermediate_size"],
        }

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        freq = shape.moe_layer_freq
        first_moe = freq.index(1) if 1 in freq else len(freq)
        if any(not moe for moe in freq[first_moe:]):
            raise ValueError(f"moe_layer_freq {list(freq)}: GLM-4.5 has dense layers only before the first MoE layer")
        return {
            "first_k_dense_replace": first_moe,
            "n_shared_experts": shape.moe_shared_expert_intermediate_size // shape.moe_ffn_hidden_size,
            "num_nextn_predict_layers": shape.mtp_num_layers or 0,
        }
