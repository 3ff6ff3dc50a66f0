"""Gemma 3 text (``Gemma3ForCausalLM``): interleaved sliding-window / global attention with two
rope bases, QK norm, norms before and after attention and MLP, (1 + w) RMSNorm, embeddings scaled
by ``sqrt(hidden_size)``, GeGLU (tanh GeLU), tied embeddings, scores scaled by
``query_pre_attn_scalar``, optional final logit soft-cap.

What megatron's GPT layer lacks comes in through :mod:`mindspeed.megatron.variants` (post-norms,
the local rope base, the embedding scale, the soft-cap) and megatron's own config fields ((1 + w)
norms, the per-layer window, the score scale); the shape fields below select them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, ConfigKey, head_dim_default, register_bridge
from mindspeed_llm.bridges.common import EMBEDDING_RULES, HF, MG, QK_NORM_RULES, gated_mlp_rules
from mindspeed_llm.bridges.rules import FuseQKV, Rename
from mindspeed_llm.bridges.shape import ModelShape

A, H = MG + "self_attention.", HF + "self_attn."

#: One decoder layer: four norms around attention and MLP (transformers' ``post_attention_layernorm``
#: is the attention output's norm here, ``pre_feedforward_layernorm`` megatron's ``pre_mlp_layernorm``).
LAYER_RULES = (
    Rename(MG + "input_layernorm.weight", HF + "input_layernorm.weight"),
    FuseQKV(A + "linear_qkv.weight", q=H + "q_proj.weight", k=H + "k_proj.weight", v=H + "v_proj.weight"),
    Rename(A + "linear_proj.weight", H + "o_proj.weight"),
    *QK_NORM_RULES,
    Rename(A + "linear_proj.post_layernorm.weight", HF + "post_attention_layernorm.weight"),
    Rename(MG + "pre_mlp_layernorm.weight", HF + "pre_feedforward_layernorm.weight"),
    *gated_mlp_rules(MG + "mlp.", HF + "mlp."),
    Rename(MG + "mlp.linear_fc2.post_layernorm.weight", HF + "post_feedforward_layernorm.weight"),
)

_FULL, _SLIDING = "full_attention", "sliding_attention"


@register_bridge
class Gemma3Bridge(Bridge):
    """Gemma 3 1B (text) and the text decoders of the larger ones (rope 'linear' on global layers)."""

    family = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM",)
    hf_model_type = "gemma3_text"
    config_keys = (
        ConfigKey("num_layers", "num_hidden_layers"),
        ConfigKey("hidden_size", "hidden_size"),
        ConfigKey("ffn_hidden_size", "intermediate_size"),
        ConfigKey("num_attention_heads", "num_attention_heads"),
        ConfigKey("num_query_groups", "num_key_value_heads", default=lambda c: c["num_attention_heads"]),
        ConfigKey("kv_channels", "head_dim", default=head_dim_default),
        ConfigKey("vocab_size", "vocab_size"),
        ConfigKey("max_position_embeddings", "max_position_embeddings"),
        ConfigKey("norm_epsilon", "rms_norm_eps"),
        ConfigKey("rotary_base", f"rope_parameters.{_FULL}.rope_theta", default=1_000_000.0),
        ConfigKey("local_rotary_base", f"rope_parameters.{_SLIDING}.rope_theta", default=10_000.0),
        ConfigKey("untie_embeddings_and_output_weights", "tie_word_embeddings", default=True, negate=True),
        ConfigKey("query_pre_attn_scalar", "query_pre_attn_scalar"),
        ConfigKey("output_logit_softcapping", "final_logit_softcapping", default=None),
    )
    constants = {"qk_layernorm": True, "swiglu": False, "geglu": True, "apply_layernorm_1p": True, "post_norm": True}
    requires = (
        ("hidden_activation", "gelu_pytorch_tanh"),
        ("attention_bias", False),
        ("use_bidirectional_attention", False),
        (f"rope_parameters.{_SLIDING}.rope_type", "default"),
    )

    rules = (*EMBEDDING_RULES, *LAYER_RULES)

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"config.json sets attn_logit_softcapping={config['attn_logit_softcapping']}; the gemma3 bridge "
                "supports only null (as Gemma 3 releases it)"
            )
        types = list(config.get("layer_types") or [])
        window = config.get("sliding_window")
        extras: dict[str, Any] = {"embedding_multiplier_scale": float(config["hidden_size"]) ** 0.5}
        if window and _SLIDING in types:
            # transformers keeps keys with q - k < sliding_window: megatron's (left, right) = (W - 1, 0).
            extras["window_size"] = (int(window) - 1, 0)
            extras["window_attn_skip_freq"] = tuple(int(kind == _SLIDING) for kind in types)
        rope = (config.get("rope_parameters") or {}).get(_FULL) or {}
        kind = rope.get("rope_type", "default")
        if kind == "linear":
            extras["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
        elif kind != "default":
            raise ValueError(
                f"config.json's rope_parameters.{_FULL}.rope_type {kind!r} is not supported: use 'default' or 'linear'"
            )
        return extras

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rotary_base}
        if shape.rotary_seq_len_interpolation_factor is not None:
            full = {**full, "rope_type": "linear", "factor": shape.rotary_seq_len_interpolation_factor}
        flags = shape.window_attn_skip_freq or (1 if shape.window_size else 0,) * shape.num_layers
        out: dict[str, Any] = {
            "rope_parameters": {
                _FULL: full,
                _SLIDING: {"rope_type": "default", "rope_theta": shape.local_rotary_base or shape.rotary_base},
            },
            "layer_types": [_SLIDING if flag else _FULL for flag in flags],
        }
        if shape.window_size is not None:
            out["sliding_window"] = shape.window_size[0] + 1
        return out
