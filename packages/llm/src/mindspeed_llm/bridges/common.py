"""Rule and config-key tables shared by the Llama-like families (each family file composes them).

``MG`` and ``HF`` are the per-layer name prefixes of megatron-core's GPTModel and of the
transformers decoder models; ``{layer}`` and ``{expert}`` are filled in by the engine.
"""

from __future__ import annotations

from mindspeed_llm.bridges.base import ConfigKey, head_dim_default
from mindspeed_llm.bridges.rules import CopyOf, Drop, FuseGateUp, FuseQKV, ParamRule, Rename, ScoreHead, Tie, for_mtp

MG = "decoder.layers.{layer}."
HF = "model.layers.{layer}."
#: A multi-token-prediction layer in megatron (``MultiTokenPredictionBlock``) and where DeepSeek-V3
#: checkpoints put it: after the decoder layers, as layer ``num_hidden_layers + index``.
MG_MTP = "mtp.layers.{mtp}."
HF_MTP = "model.layers.{mtp_layer}."

#: Embedding, final norm and output layer (tied or not; a score head in ``*ForSequenceClassification``).
EMBEDDING_RULES: tuple[ParamRule, ...] = (
    Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Rename("decoder.final_layernorm.weight", "model.norm.weight"),
    Tie("output_layer.weight", "lm_head.weight"),
    ScoreHead("output_layer.weight", "score.weight"),
)

#: Norms and grouped-query attention without biases; old checkpoints' rotary buffers are dropped.
ATTENTION_RULES: tuple[ParamRule, ...] = (
    Rename(MG + "input_layernorm.weight", HF + "input_layernorm.weight"),
    FuseQKV(
        MG + "self_attention.linear_qkv.weight",
        q=HF + "self_attn.q_proj.weight",
        k=HF + "self_attn.k_proj.weight",
        v=HF + "self_attn.v_proj.weight",
    ),
    Rename(MG + "self_attention.linear_proj.weight", HF + "self_attn.o_proj.weight"),
    Rename(MG + "pre_mlp_layernorm.weight", HF + "post_attention_layernorm.weight"),
    Drop(HF + "self_attn.rotary_emb.inv_freq"),
)

#: The q/k/v biases of Qwen2-style attention.
QKV_BIAS_RULES: tuple[ParamRule, ...] = (
    FuseQKV(
        MG + "self_attention.linear_qkv.bias",
        q=HF + "self_attn.q_proj.bias",
        k=HF + "self_attn.k_proj.bias",
        v=HF + "self_attn.v_proj.bias",
    ),
)

#: Per-head RMSNorm of queries and keys (Qwen3).
QK_NORM_RULES: tuple[ParamRule, ...] = (
    Rename(MG + "self_attention.q_layernorm.weight", HF + "self_attn.q_norm.weight"),
    Rename(MG + "self_attention.k_layernorm.weight", HF + "self_attn.k_norm.weight"),
)


def gated_mlp_rules(
    mg: str, hf: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj", layers: str = "all"
) -> tuple[ParamRule, ...]:
    """A SwiGLU MLP: ``gate``/``up`` fused into ``linear_fc1``, ``down`` renamed to ``linear_fc2``.

    Args:
        mg: megatron module prefix (``decoder.layers.{layer}.mlp.``).
        hf: Hugging Face module prefix (``model.layers.{layer}.mlp.``).
        gate: name of the gate projection under ``hf``.
        up: name of the up projection.
        down: name of the down projection.
        layers: which layers (``"all"``, ``"dense"``, ``"moe"``).
    """
    return (
        FuseGateUp(mg + "linear_fc1.weight", gate=f"{hf}{gate}.weight", up=f"{hf}{up}.weight", layers=layers),
        Rename(mg + "linear_fc2.weight", f"{hf}{down}.weight", layers=layers),
    )


#: Config keys every Llama-like family shares.
LLAMA_CONFIG_KEYS: tuple[ConfigKey, ...] = (
    ConfigKey("num_layers", "num_hidden_layers"),
    ConfigKey("hidden_size", "hidden_size"),
    ConfigKey("ffn_hidden_size", "intermediate_size"),
    ConfigKey("num_attention_heads", "num_attention_heads"),
    ConfigKey("num_query_groups", "num_key_value_heads", default=lambda c: c["num_attention_heads"]),
    ConfigKey("kv_channels", "head_dim", default=head_dim_default, omit_default=True),
    ConfigKey("vocab_size", "vocab_size"),
    ConfigKey("max_position_embeddings", "max_position_embeddings"),
    ConfigKey("norm_epsilon", "rms_norm_eps"),
    ConfigKey("rotary_base", "rope_parameters.rope_theta", default=10000.0),
    ConfigKey("untie_embeddings_and_output_weights", "tie_word_embeddings", default=False, negate=True),
)

#: What megatron's local GPT layer cannot represent in a Llama-like config.
LLAMA_REQUIRES: tuple[tuple[str, object], ...] = (("hidden_act", "silu"), ("rope_parameters.rope_type", "default"))


def moe_rules(hf_mlp: str, router: str, gate: str, up: str, down: str) -> tuple[ParamRule, ...]:
    """A routed-experts MLP: the router plus one gated MLP per expert (``{expert}`` in the names).

    Args:
        hf_mlp: Hugging Face MoE block prefix (``model.layers.{layer}.mlp.``).
        router: the router's module name under ``hf_mlp`` (``gate``).
        gate: an expert's gate projection name (``gate_proj`` or Mixtral's ``w1``).
        up: an expert's up projection name.
        down: an expert's down projection name.
    """
    return (
        Rename(MG + "mlp.router.weight", f"{hf_mlp}{router}.weight", layers="moe"),
        *gated_mlp_rules(MG + "mlp.experts.local_experts.{expert}.", hf_mlp + "experts.{expert}.", gate, up, down),
    )


def mtp_rules(layer_rules: tuple[ParamRule, ...]) -> tuple[ParamRule, ...]:
    """DeepSeek-V3-style multi-token-prediction layers, in the checkpoint layout transformers'
    ``MtpModel`` reads: ``enorm`` (embedding norm), ``hnorm`` (hidden-state norm), ``eh_proj``
    (over ``[embedding; hidden]``, megatron's order too), a decoder layer under the same prefix
    (``layer_rules`` rewritten), ``shared_head.norm`` (megatron's ``final_layernorm``), and
    copies of the embedding and the output head, which megatron shares with the main model.

    Args:
        layer_rules: the family's rules; those of a decoder layer (``MG`` prefix) are reused.
    """
    return (
        Rename(MG_MTP + "enorm.weight", HF_MTP + "enorm.weight"),
        Rename(MG_MTP + "hnorm.weight", HF_MTP + "hnorm.weight"),
        Rename(MG_MTP + "eh_proj.weight", HF_MTP + "eh_proj.weight"),
        *for_mtp(layer_rules, MG, HF, MG_MTP + "transformer_layer.", HF_MTP),
        Rename(MG_MTP + "final_layernorm.weight", HF_MTP + "shared_head.norm.weight"),
        CopyOf(HF_MTP + "embed_tokens.weight", of="model.embed_tokens.weight"),
        CopyOf(HF_MTP + "shared_head.head.weight", of="lm_head.weight", of_tied="model.embed_tokens.weight"),
    )
