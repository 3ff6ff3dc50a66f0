"""Qwen3-Next (``Qwen3NextForCausalLM``): hybrid layers, Gated DeltaNet linear attention with gated
softmax attention every ``full_attention_interval`` layers; MoE with a shared expert.

- linear layers (``layer_types`` ``linear_attention``): megatron's ``GatedDeltaNet`` on the
  registry (:class:`mindspeed.megatron.gated_delta_net.RegistryGatedDeltaNet`); transformers'
  per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba`` become megatron's ``in_proj``
  ``[q | k | v | z | b | a]`` (:class:`~mindspeed_llm.bridges.rules.FuseDeltaNetInProj`), which
  tensor parallelism cuts section by section (``Split.SECTIONS``), as the ``conv1d`` over
  ``[q | k | v]``; the gated output norm keeps a plain weight;
- full layers: grouped-query attention whose query projection also emits a sigmoid output gate
  per head (megatron's ``attention_output_gate``), QK norm, partial rotary (the first
  ``partial_rotary_factor`` of each head's channels);
- every other norm is zero-centred (``1 + w``: megatron's ``layernorm_zero_centered_gamma``);
- MoE layers: softmax router (``norm_topk_prob`` renormalises the top k), routed experts and a
  shared expert scaled by ``sigmoid(shared_expert_gate(x))`` (megatron's ``moe_shared_expert_gate``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, head_dim_default, register_bridge
from mindspeed_llm.bridges.common import (
    EMBEDDING_RULES,
    HF,
    LLAMA_CONFIG_KEYS,
    LLAMA_REQUIRES,
    MG,
    gated_mlp_rules,
    moe_rules,
)
from mindspeed_llm.bridges.rules import FuseDeltaNetInProj, FuseGatedQKV, Rename
from mindspeed_llm.bridges.shape import ModelShape

A, H, L, HL = MG + "self_attention.", HF + "self_attn.", "linear", HF + "linear_attn."

#: Norms, gated softmax attention (full layers) or Gated DeltaNet (linear layers).
MIXER_RULES = (
    Rename(MG + "input_layernorm.weight", HF + "input_layernorm.weight"),
    Rename(MG + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight"),
    FuseGatedQKV(A + "linear_qkv.weight", H + "q_proj.weight", H + "k_proj.weight", H + "v_proj.weight", "attention"),
    Rename(A + "linear_proj.weight", H + "o_proj.weight", layers="attention"),
    Rename(A + "q_layernorm.weight", H + "q_norm.weight", layers="attention"),
    Rename(A + "k_layernorm.weight", H + "k_norm.weight", layers="attention"),
    FuseDeltaNetInProj(A + "in_proj.weight", HL + "in_proj_qkvz.weight", HL + "in_proj_ba.weight", L),
    Rename(A + "conv1d.weight", HL + "conv1d.weight", layers=L),
    Rename(A + "dt_bias", HL + "dt_bias", layers=L),
    Rename(A + "A_log", HL + "A_log", layers=L),
    Rename(A + "out_norm.weight", HL + "norm.weight", layers=L),
    Rename(A + "out_proj.weight", HL + "out_proj.weight", layers=L),
)

_LINEAR, _FULL = "linear_attention", "full_attention"


@register_bridge
class Qwen3NextBridge(Bridge):
    """Qwen3-Next-80B-A3B (Instruct / Thinking). Layers in ``mlp_only_layers`` (or off the
    ``decoder_sparse_step`` grid) keep a dense MLP, as in Qwen3-MoE."""

    family = "qwen3-next"
    hf_architectures = ("Qwen3NextForCausalLM",)
    hf_model_type = "qwen3_next"
    config_keys = (
        # Qwen3NextConfig defaults head_dim to 256 (not hidden / heads): always written.
        *(key for key in LLAMA_CONFIG_KEYS if key.mg != "kv_channels"),
        ConfigKey("kv_channels", "head_dim", default=head_dim_default),
        # Qwen3NextConfig defaults partial_rotary_factor to 0.25.
        ConfigKey("rotary_percent", "rope_parameters.partial_rotary_factor", default=0.25),
        ConfigKey("num_experts", "num_experts"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_ffn_hidden_size", "moe_intermediate_size"),
        ConfigKey("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size"),
        ConfigKey("moe_router_pre_softmax", "norm_topk_prob", default=True, negate=True),
        ConfigKey("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
        ConfigKey("linear_key_head_dim", "linear_key_head_dim"),
        ConfigKey("linear_value_head_dim", "linear_value_head_dim"),
        ConfigKey("linear_num_key_heads", "linear_num_key_heads"),
        ConfigKey("linear_num_value_heads", "linear_num_value_heads"),
    )
    constants = {
        "qk_layernorm": True,
        "apply_layernorm_1p": True,
        "attention_output_gate": True,
        "moe_shared_expert_gate": True,
    }
    requires = (*LLAMA_REQUIRES, ("attention_bias", False))
    capabilities = Capabilities(moe=True, shared_experts=True)
    rules = (
        *EMBEDDING_RULES,
        *MIXER_RULES,
        *gated_mlp_rules(MG + "mlp.", HF + "mlp.", layers="dense"),
        *moe_rules(HF + "mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj"),
        *gated_mlp_rules(MG + "mlp.shared_experts.", HF + "mlp.shared_expert.", layers="moe"),
        Rename(MG + "mlp.shared_experts.gate_weight", HF + "mlp.shared_expert_gate.weight", layers="moe"),
    )

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        count = config["num_hidden_layers"]
        dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step") or 1
        types = list(config.get("layer_types") or [])
        if not types:  # transformers' default: full attention every full_attention_interval layers
            interval = config.get("full_attention_interval") or 4
            types = [_FULL if (i + 1) % interval == 0 else _LINEAR for i in range(count)]
        unknown = sorted(set(types) - {_LINEAR, _FULL})
        if unknown or len(types) != count:
            raise ValueError(f"config.json's layer_types {types} must list {count} entries of {_LINEAR!r} or {_FULL!r}")
        return {
            "moe_layer_freq": tuple(int(i not in dense and (i + 1) % step == 0) for i in range(count)),
            "linear_attention_freq": tuple(int(kind == _LINEAR) for kind in types),
        }

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        freq = shape.linear_attention_freq or (0,) * shape.num_layers
        return {
            "mlp_only_layers": [i for i, moe in enumerate(shape.moe_layer_freq or ()) if not moe],
            "decoder_sparse_step": 1,
            "layer_types": [_LINEAR if flag else _FULL for flag in freq],
        }
