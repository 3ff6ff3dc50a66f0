"""One tiny transformers config per bridged family, built in code (no downloads).

The registry :data:`TINY_CONFIGS` is keyed by the bridge family name; a test checks that every
registered bridge has an entry here and the other way round. The sizes are small enough to
convert and run in milliseconds and large enough to exercise every layout the tests use:
4 layers (PP 2, VPP 2 x 1), 4 query heads in 2 groups (TP 2), even MLP widths, 4 experts (EP 2).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mindspeed.registry import Registry

#: family -> function returning a ``transformers.PretrainedConfig``.
TINY_CONFIGS: Registry[Callable[[], Any]] = Registry("tiny model config")

#: Shape shared by the dense families.
_DENSE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


@TINY_CONFIGS.register("llama2")
def tiny_llama() -> Any:
    """Llama 3.1-style: untied, rope scaling 'llama3'."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return LlamaConfig(
        **{**_DENSE, "max_position_embeddings": 131072},
        vocab_size=128,
        rope_parameters=rope,
        architectures=["LlamaForCausalLM"],
    )


@TINY_CONFIGS.register("mistral")
def tiny_mistral() -> Any:
    """Mistral without a sliding window (the window is a runtime setting, not a weight)."""
    from transformers import MistralConfig

    return MistralConfig(**_DENSE, vocab_size=128, sliding_window=None, architectures=["MistralForCausalLM"])


@TINY_CONFIGS.register("qwen25")
def tiny_qwen2() -> Any:
    """Qwen2.5-style: q/k/v biases, tied embeddings, and a vocabulary TP 2 must pad (131 rows)."""
    from transformers import Qwen2Config

    dense = {k: v for k, v in _DENSE.items() if k != "head_dim"}
    return Qwen2Config(
        **dense,
        vocab_size=131,
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        architectures=["Qwen2ForCausalLM"],
    )


@TINY_CONFIGS.register("qwen3")
def tiny_qwen3() -> Any:
    """Qwen3-style: QK norm, head_dim independent of hidden_size / heads."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**_DENSE, "head_dim": 24}, vocab_size=128, architectures=["Qwen3ForCausalLM"])


@TINY_CONFIGS.register("mixtral")
def tiny_mixtral() -> Any:
    """Mixtral-style: 4 experts, top-2, every layer MoE."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{**_DENSE, "intermediate_size": 48},
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        architectures=["MixtralForCausalLM"],
    )


@TINY_CONFIGS.register("qwen3-moe")
def tiny_qwen3_moe() -> Any:
    """Qwen3-MoE-style: QK norm, 4 experts top-2 without renormalisation, layer 0 dense."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_DENSE,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


@TINY_CONFIGS.register("qwen2-moe")
def tiny_qwen2_moe() -> Any:
    """Qwen2-MoE-style: q/k/v biases, 4 experts top-2 without renormalisation, a gated shared
    expert of its own width, layer 0 dense."""
    from transformers import Qwen2MoeConfig

    dense = {k: v for k, v in _DENSE.items() if k != "head_dim"}
    return Qwen2MoeConfig(
        **dense,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=False,
        architectures=["Qwen2MoeForCausalLM"],
    )


@TINY_CONFIGS.register("gemma3")
def tiny_gemma3() -> Any:
    """Gemma 3-style: a window of 4 tokens on layers 0, 1 and 3 (layer 2 global: on the second
    pipeline stage, its first layer), rope 'linear' (factor 8) on the global layer and its own base
    on the others, scores scaled by query_pre_attn_scalar 32 (not head_dim), and a logit soft-cap
    of 5 (small, so that random-weight logits feel it)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{k: v for k, v in _DENSE.items() if k != "rms_norm_eps"},
        rms_norm_eps=1e-6,
        vocab_size=128,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        query_pre_attn_scalar=32,
        final_logit_softcapping=5.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Gemma3ForCausalLM"],
    )


@TINY_CONFIGS.register("bloom")
def tiny_bloom() -> Any:
    """BLOOM-style: ALiBi over 6 heads (not a power of two: the interleaved slopes), LayerNorms with
    biases (one after the embeddings), biases everywhere, tanh-GeLU MLP, tied embeddings."""
    from transformers import BloomConfig

    return BloomConfig(
        vocab_size=128, hidden_size=96, n_layer=4, n_head=6, layer_norm_epsilon=1e-5, architectures=["BloomForCausalLM"]
    )


@TINY_CONFIGS.register("deepseek3")
def tiny_deepseek_v3() -> Any:
    """DeepSeek-V3-style: MLA, layer 0 dense, 4 sigmoid-routed experts in 2 groups, a shared expert
    (rms_norm_eps 1e-6 as released: transformers' MLA norms always use 1e-6)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        vocab_size=128,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=["DeepseekV3ForCausalLM"],
    )


@TINY_CONFIGS.register("glm45-moe")
def tiny_glm45() -> Any:
    """GLM-4.5-style: q/k/v biases, QK norm, head_dim 24 (not hidden / heads), half of each head
    rotating (partial_rotary_factor 0.5), layer 0 dense, 4 sigmoid-routed experts in 2 groups with
    a selection bias (perturbed with the weights), a shared expert, routed_scaling_factor 2.5."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **{**_DENSE, "head_dim": 24},
        vocab_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        architectures=["Glm4MoeForCausalLM"],
    )


@TINY_CONFIGS.register("gpt-oss")
def tiny_gpt_oss() -> Any:
    """GPT-OSS-style, 2 layers (sliding window of 4 tokens, then full attention), q/k/v/o biases and
    sinks, 4 experts (top 2) with router and expert biases, the clamped SwiGLU (alpha 1.702; limit 0.3, not 7: small, so that
    random-weight activations reach it),
    and YaRN (factor 8 over an original context of 16, not truncated as released)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        **{**_DENSE, "num_hidden_layers": 2, "intermediate_size": 32},
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=0.3,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )


@TINY_CONFIGS.register("qwen3-next")
def tiny_qwen3_next() -> Any:
    """Qwen3-Next-style: Gated DeltaNet layers (2 key heads of 16, 4 value heads of 8, conv width 4)
    with gated full attention every second layer (QK norm, a quarter of each head rotating), (1 + w)
    norms, layer 0 dense, 4 experts top-2 renormalised plus a gated shared expert of width 48."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_DENSE,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        partial_rotary_factor=0.25,
        architectures=["Qwen3NextForCausalLM"],
    )


#: Families whose persistent buffers (the expert selection bias) get noise too. Not deepseek3:
#: with a non-zero bias, transformers' DeepseekV3 ``generate`` (cached decode) leaves its own
#: uncached forward on the tiny model (prompt seed 3: token 39 where the forward's argmax is 1,
#: logit gap 0.026), which the greedy test would blame on the engine.
PERTURBED_BUFFERS = ("glm45-moe",)


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A tiny random-weight ``AutoModelForCausalLM`` of ``family``.

    Every parameter gets noise on top of transformers' init, so that norm weights, biases and
    router biases are not the constants a wrong mapping could get away with; so do the persistent
    float buffers (the routers' ``e_score_correction_bias``) of the families in
    :data:`PERTURBED_BUFFERS`.

    Args:
        family: a key of :data:`TINY_CONFIGS`.
        seed: torch seed of the weights.
        dtype: parameter dtype.
    """
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS.get(family)()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        persistent = model.state_dict(keep_vars=True) if family in PERTURBED_BUFFERS else {}
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.add_(torch.randn_like(buffer) * 0.05)
    return model.to(dtype).eval()


def save_tiny_checkpoint(
    family: str, path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32, max_shard_size: str = "64KB"
) -> Any:
    """Write a tiny Hugging Face checkpoint of ``family`` (sharded safetensors, tokenizer, generation config).

    Args:
        family: a key of :data:`TINY_CONFIGS`.
        path: the directory to write.
        seed: torch seed of the weights.
        dtype: parameter dtype.
        max_shard_size: safetensors shard size (small, so that tensors spread over several files).

    Returns:
        The model that was saved.
    """
    model = build_tiny_model(family, seed, dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    write_tiny_tokenizer(path)
    return model


def write_tiny_tokenizer(path: str | Path) -> None:
    """A small word-level fast tokenizer (tokenizer.json + tokenizer_config.json) in ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(60)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
