"""Qwen2-MoE / Qwen1.5-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention (q/k/v biases), softmax-routed
experts and one shared expert whose output a learned sigmoid gate scales, optional dense layers."""

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
    QKV_BIAS_RULES,
    gated_mlp_rules,
    moe_rules,
)
from mindspeed_llm.bridges.rules import Rename
from mindspeed_llm.bridges.shape import ModelShape


@register_bridge
class Qwen2MoeBridge(Bridge):
    """Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B. megatron's ``moe_shared_expert_gate`` is the
    ``shared_expert_gate`` (``sigmoid(x @ w.T)`` times the shared expert's output); layers in
    ``mlp_only_layers`` (or off the ``decoder_sparse_step`` grid) keep a dense MLP."""

    family = "qwen2-moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    hf_model_type = "qwen2_moe"
    config_keys = (
        *LLAMA_CONFIG_KEYS,
        ConfigKey("num_experts", "num_experts"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size"),
        ConfigKey("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"),
        # Without renormalisation the top-k weights are slices of the softmax over all experts.
        ConfigKey("moe_router_pre_softmax", "norm_topk_prob", default=False, negate=True),
    )
    constants = {"add_qkv_bias": True, "moe_shared_expert_gate": True}
    # q/k/v biases and no o_proj bias are megatron's add_qkv_bias; a sliding window is not a weight
    # but megatron's layers do not window.
    requires = (*LLAMA_REQUIRES, ("qkv_bias", True), ("use_sliding_window", False))
    capabilities = Capabilities(moe=True, shared_experts=True)
    rules = (
        *EMBEDDING_RULES,
        *ATTENTION_RULES,
        *QKV_BIAS_RULES,
        *gated_mlp_rules(MG + "mlp.", HF + "mlp.", layers="dense"),
        *moe_rules(HF + "mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj"),
        *gated_mlp_rules(MG + "mlp.shared_experts.", HF + "mlp.shared_expert.", layers="moe"),
        Rename(MG + "mlp.shared_experts.gate_weight", HF + "mlp.shared_expert_gate.weight", layers="moe"),
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
