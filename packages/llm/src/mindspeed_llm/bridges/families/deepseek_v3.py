"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention, sigmoid-routed experts with a score
bias, shared experts, the first k layers dense, multi-token-prediction layers converted on request
(``--mtp-num-layers``), else dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, register_bridge
from mindspeed_llm.bridges.common import EMBEDDING_RULES, HF, MG, gated_mlp_rules, moe_rules, mtp_rules
from mindspeed_llm.bridges.rules import DropExtraLayers, Rename
from mindspeed_llm.bridges.shape import ModelShape

A, H = MG + "self_attention.", HF + "self_attn."

#: MLA projections: each Hugging Face projection is one megatron linear (same row layout:
#: per head [nope; rope] for q, per head [k_nope; v] for kv_b, [latent; k_rope] for kv_a).
MLA_RULES = (
    Rename(MG + "input_layernorm.weight", HF + "input_layernorm.weight"),
    Rename(A + "linear_q_down_proj.weight", H + "q_a_proj.weight"),
    Rename(A + "q_layernorm.weight", H + "q_a_layernorm.weight"),
    Rename(A + "linear_q_up_proj.weight", H + "q_b_proj.weight"),
    Rename(A + "linear_kv_down_proj.weight", H + "kv_a_proj_with_mqa.weight"),
    Rename(A + "kv_layernorm.weight", H + "kv_a_layernorm.weight"),
    Rename(A + "linear_kv_up_proj.weight", H + "kv_b_proj.weight"),
    Rename(A + "linear_proj.weight", H + "o_proj.weight"),
    Rename(MG + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight"),
)

#: One decoder layer: MLA, then a dense MLP (first k layers) or routed + shared experts.
LAYER_RULES = (
    *MLA_RULES,
    *gated_mlp_rules(MG + "mlp.", HF + "mlp.", layers="dense"),
    *moe_rules(HF + "mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj"),
    Rename(MG + "mlp.router.expert_bias", HF + "mlp.gate.e_score_correction_bias", layers="moe"),
    *gated_mlp_rules(MG + "mlp.shared_experts.", HF + "mlp.shared_experts.", layers="moe"),
)

#: YaRN settings of megatron's MLA config and their Hugging Face ``rope_parameters`` keys.
_YARN = {
    "rotary_scaling_factor": "factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_max_position_embeddings": "original_max_position_embeddings",
}


@register_bridge
class DeepseekV3Bridge(Bridge):
    """DeepSeek-V3 / R1.

    transformers (like DeepSeek's own code) builds the q_a / kv_a layernorms with eps 1e-6
    whatever ``rms_norm_eps`` says, while megatron uses one epsilon for every norm: the two agree
    for the released configs (``rms_norm_eps`` 1e-6).
    """

    family = "deepseek3"
    hf_architectures = ("DeepseekV3ForCausalLM",)
    hf_model_type = "deepseek_v3"
    config_keys = (
        ConfigKey("num_layers", "num_hidden_layers"),
        ConfigKey("hidden_size", "hidden_size"),
        ConfigKey("ffn_hidden_size", "intermediate_size"),
        ConfigKey("num_attention_heads", "num_attention_heads"),
        ConfigKey("num_query_groups", "num_key_value_heads", default=lambda c: c["num_attention_heads"]),
        ConfigKey("kv_channels", "v_head_dim"),
        ConfigKey("vocab_size", "vocab_size"),
        ConfigKey("max_position_embeddings", "max_position_embeddings"),
        ConfigKey("norm_epsilon", "rms_norm_eps"),
        ConfigKey("rotary_base", "rope_parameters.rope_theta", default=10000.0),
        ConfigKey("untie_embeddings_and_output_weights", "tie_word_embeddings", default=False, negate=True),
        ConfigKey("q_lora_rank", "q_lora_rank"),
        ConfigKey("kv_lora_rank", "kv_lora_rank"),
        ConfigKey("qk_head_dim", "qk_nope_head_dim"),
        ConfigKey("qk_pos_emb_head_dim", "qk_rope_head_dim"),
        ConfigKey("v_head_dim", "v_head_dim"),
        ConfigKey("num_experts", "n_routed_experts"),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_router_num_groups", "n_group"),
        ConfigKey("moe_router_group_topk", "topk_group"),
        ConfigKey("moe_router_topk_scaling_factor", "routed_scaling_factor"),
    )
    constants = {
        "multi_latent_attention": True,
        "qk_layernorm": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
    }
    # megatron renormalises sigmoid top-k weights always; the MLA rope is de-interleaved by
    # megatron exactly as transformers does with rope_interleave.
    requires = (("hidden_act", "silu"), ("norm_topk_prob", True), ("rope_interleave", True), ("attention_bias", False))
    mtp_config_key = "num_nextn_predict_layers"
    capabilities = Capabilities(moe=True, shared_experts=True, mla=True, mtp=True)
    rules = (*EMBEDDING_RULES, *LAYER_RULES, *mtp_rules(LAYER_RULES), DropExtraLayers())

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        dense = config.get("first_k_dense_replace") or 0
        step = config.get("moe_layer_freq") or 1
        extras: dict[str, Any] = {
            "moe_layer_freq": tuple(
                int(i >= dense and (i - dense) % step == 0) for i in range(config["num_hidden_layers"])
            ),
            "moe_shared_expert_intermediate_size": (config.get("n_shared_experts") or 0)
            * config["moe_intermediate_size"]
            or None,
        }
        rope = config.get("rope_parameters") or {}
        kind = rope.get("rope_type", "default")
        if kind == "yarn":
            extras["rope_type"] = "yarn"
            extras.update({mg: rope[hf] for mg, hf in _YARN.items() if rope.get(hf) is not None})
        elif kind != "default":
            raise ValueError(
                f"config.json's rope_type {kind!r} is not supported for MLA: megatron implements 'default' and 'yarn'"
            )
        return extras

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        freq = shape.moe_layer_freq
        out: dict[str, Any] = {
            "first_k_dense_replace": freq.index(1) if 1 in freq else len(freq),
            "moe_layer_freq": 1,
            "n_shared_experts": (shape.moe_shared_expert_intermediate_size or 0) // shape.moe_ffn_hidden_size,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": shape.mtp_num_layers or 0,
        }
        if shape.rope_type == "yarn":
            out["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": shape.rotary_base,
                **{hf: getattr(shape, mg) for mg, hf in _YARN.items()},
            }
        return out
