"""BLOOM (``BloomForCausalLM``): ALiBi instead of position embeddings, LayerNorm with biases
(also right after the word embeddings), biases in every linear layer, a plain tanh-GeLU MLP of
width ``4 * hidden_size``, tied embeddings.

BLOOM's fused ``query_key_value`` holds, per head, its query, key and value rows: megatron's
grouped QKV layout with one query per group (multi-head attention), so it is renamed as is and
tensor parallelism cuts whole heads. ALiBi comes from the layer spec
(:class:`~mindspeed.megatron.modules.RegistryAttention` with the slopes of each rank's heads) and
the embedding norm from :mod:`mindspeed.megatron.variants`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mindspeed_llm.bridges.base import Bridge, Capabilities, ConfigKey, register_bridge
from mindspeed_llm.bridges.megatron_params import EMBEDDING_NORM
from mindspeed_llm.bridges.rules import Rename, Tie

MG, HF = "decoder.layers.{layer}.", "transformer.h.{layer}."


def _both(mg: str, hf: str) -> tuple[Rename, Rename]:
    """A module's weight and bias under the same names."""
    return Rename(f"{mg}.weight", f"{hf}.weight"), Rename(f"{mg}.bias", f"{hf}.bias")


RULES = (
    Rename("embedding.word_embeddings.weight", "transformer.word_embeddings.weight"),
    *_both(f"embedding.{EMBEDDING_NORM}", "transformer.word_embeddings_layernorm"),
    *_both(MG + "input_layernorm", HF + "input_layernorm"),
    *_both(MG + "self_attention.linear_qkv", HF + "self_attention.query_key_value"),
    *_both(MG + "self_attention.linear_proj", HF + "self_attention.dense"),
    *_both(MG + "pre_mlp_layernorm", HF + "post_attention_layernorm"),
    *_both(MG + "mlp.linear_fc1", HF + "mlp.dense_h_to_4h"),
    *_both(MG + "mlp.linear_fc2", HF + "mlp.dense_4h_to_h"),
    *_both("decoder.final_layernorm", "transformer.ln_f"),
    Tie("output_layer.weight", "lm_head.weight"),
)


@register_bridge
class BloomBridge(Bridge):
    """BLOOM and BLOOMZ."""

    family = "bloom"
    hf_architectures = ("BloomForCausalLM",)
    hf_model_type = "bloom"
    config_keys = (
        ConfigKey("num_layers", "n_layer"),
        ConfigKey("hidden_size", "hidden_size"),
        ConfigKey("num_attention_heads", "n_head"),
        ConfigKey("vocab_size", "vocab_size"),
        ConfigKey("norm_epsilon", "layer_norm_epsilon"),
        ConfigKey("untie_embeddings_and_output_weights", "tie_word_embeddings", default=True, negate=True),
    )
    constants = {
        "normalization": "LayerNorm",
        "swiglu": False,
        "gelu_tanh": True,
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "embedding_layernorm": True,
        "position_embedding_type": "alibi",
    }
    # The residual after the norm and tensor-parallel-exact slicing change the model's function.
    requires = (("apply_residual_connection_post_layernorm", False), ("pretraining_tp", 1))
    rules = RULES
    # The built-in inference decoder has no ALiBi or embedding norm yet.
    capabilities = Capabilities(infers=False)

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        hidden, heads = int(config["hidden_size"]), int(config["n_head"])
        return {
            "ffn_hidden_size": 4 * hidden,
            "num_query_groups": heads,
            "kv_channels": hidden // heads,
            # ALiBi has no length limit; megatron wants a number (only rope tables use it).
            "max_position_embeddings": int(config.get("seq_length") or 2048),
        }
