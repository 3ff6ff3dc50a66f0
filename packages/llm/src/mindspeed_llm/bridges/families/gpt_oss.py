"""GPT-OSS (``GptOssForCausalLM``): grouped-query attention with biases and a learnable sink logit
per head, sliding-window layers alternating with full ones, YaRN rope, and MoE layers whose router
and experts have biases and whose experts apply a clamped SwiGLU, ``(clamp(up) + 1) *
clamp(gate) * sigmoid(1.702 * clamp(gate))``.

megatron-core 0.16 has every piece as a config field: ``softmax_type='learnable'`` (the sinks; on
the registry attention, see :class:`mindspeed.megatron.modules.RegistryAttention`),
``window_size`` / ``window_attn_skip_freq``, ``position_embedding_type='yarn'``,
``add_bias_linear`` (router, experts, attention), ``quick_gelu`` with ``glu_linear_offset`` 1
and ``activation_func_clamp_value``. transformers stacks a layer's experts in one tensor
(``gate_up_proj [experts, hidden, 2 * ffn]``, gate and up interleaved; ``down_proj [experts,
ffn, hidden]``), and the released checkpoints hold the two in MXFP4: the bridge's
:data:`STACKS` let the rules see one expert at a time (:mod:`mindspeed_llm.bridges.stacked`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, head_dim_default, register_bridge
from mindspeed_llm.bridges.common import ATTENTION_RULES, EMBEDDING_RULES, HF, LLAMA_CONFIG_KEYS, MG, QKV_BIAS_RULES
from mindspeed_llm.bridges.rules import InterleavedGateUp, Rename, Transposed
from mindspeed_llm.bridges.shape import ModelShape
from mindspeed_llm.bridges.stacked import StackedTensor

_EXPERTS, _LOCAL = HF + "mlp.experts.", MG + "mlp.experts.local_experts.{expert}."

#: The stacked expert tensors and the per-expert names the rules read; the weights may be MXFP4.
STACKS = (
    StackedTensor(_EXPERTS + "gate_up_proj", _EXPERTS + "{expert}.gate_up_proj", mxfp4=True),
    StackedTensor(_EXPERTS + "gate_up_proj_bias", _EXPERTS + "{expert}.gate_up_proj_bias"),
    StackedTensor(_EXPERTS + "down_proj", _EXPERTS + "{expert}.down_proj", mxfp4=True),
    StackedTensor(_EXPERTS + "down_proj_bias", _EXPERTS + "{expert}.down_proj_bias"),
)

LAYER_RULES = (
    *ATTENTION_RULES,
    *QKV_BIAS_RULES,
    Rename(MG + "self_attention.linear_proj.bias", HF + "self_attn.o_proj.bias"),
    Rename(MG + "self_attention.core_attention.softmax_offset", HF + "self_attn.sinks"),
    Rename(MG + "mlp.router.weight", HF + "mlp.router.weight", layers="moe"),
    Rename(MG + "mlp.router.bias", HF + "mlp.router.bias", layers="moe"),
    InterleavedGateUp(_LOCAL + "linear_fc1.weight", _EXPERTS + "{expert}.gate_up_proj", transposed=True),
    InterleavedGateUp(_LOCAL + "linear_fc1.bias", _EXPERTS + "{expert}.gate_up_proj_bias"),
    Transposed(_LOCAL + "linear_fc2.weight", _EXPERTS + "{expert}.down_proj"),
    Rename(_LOCAL + "linear_fc2.bias", _EXPERTS + "{expert}.down_proj_bias"),
)

_FULL, _SLIDING = "full_attention", "sliding_attention"
_ROPE = "rope_parameters."


@register_bridge
class GptOssBridge(Bridge):
    """gpt-oss-20b and gpt-oss-120b (bf16, or their released MXFP4 experts, dequantised as transformers does)."""

    family = "gpt-oss"
    hf_architectures = ("GptOssForCausalLM",)
    hf_model_type = "gpt_oss"
    config_keys = (
        # GptOssConfig defaults head_dim to 64 (not hidden / heads): always written.
        *(key for key in LLAMA_CONFIG_KEYS if key.mg not in ("rotary_base", "kv_channels")),
        ConfigKey("kv_channels", "head_dim", default=head_dim_default),
        ConfigKey("rotary_base", _ROPE + "rope_theta", default=150000.0),
        ConfigKey("num_experts", "num_local_experts"),
        ConfigKey("moe_router_topk", "num_experts_per_tok"),
        ConfigKey("moe_ffn_hidden_size", "intermediate_size"),
        ConfigKey("activation_clamp", "swiglu_limit", default=7.0),
        ConfigKey("rotary_scaling_factor", _ROPE + "factor"),
        ConfigKey("original_max_position_embeddings", _ROPE + "original_max_position_embeddings"),
        ConfigKey("beta_fast", _ROPE + "beta_fast", default=32.0),
        ConfigKey("beta_slow", _ROPE + "beta_slow", default=1.0),
        ConfigKey("yarn_truncate", _ROPE + "truncate", default=True),
    )
    constants = {
        "add_bias_linear": True,
        "softmax_sinks": True,
        "swiglu": False,
        "quick_geglu": True,
        "glu_linear_offset": 1.0,
        "position_embedding_type": "yarn",
    }
    # megatron's quick_gelu has GPT-OSS's alpha (1.702) built in.
    requires = (("swiglu_alpha", 1.702), ("attention_bias", True), (_ROPE + "rope_type", "yarn"))
    capabilities = Capabilities(moe=True)
    hf_stacks = STACKS
    rules = (*EMBEDDING_RULES, *LAYER_RULES)

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        rope = config.get("rope_parameters") or {}
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                raise ValueError(f"config.json sets rope_parameters.{key}; the gpt-oss bridge supports YaRN without it")
        types = list(config.get("layer_types") or [])
        extras: dict[str, Any] = {}
        window = config.get("sliding_window")
        if window and _SLIDING in types:
            # transformers keeps keys with q - k < sliding_window: megatron's (left, right) = (W - 1, 0).
            extras["window_size"] = (int(window) - 1, 0)
            extras["window_attn_skip_freq"] = tuple(int(kind == _SLIDING) for kind in types)
        return extras

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        flags = shape.window_attn_skip_freq or (1 if shape.window_size else 0,) * shape.num_layers
        out: dict[str, Any] = {"layer_types": [_SLIDING if flag else _FULL for flag in flags]}
        if shape.window_size is not None:
            out["sliding_window"] = shape.window_size[0] + 1
        return out
