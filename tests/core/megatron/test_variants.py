"""Gemma-style pieces of the megatron modules, each against its definition (the whole model is
proven against transformers in tests/llm: test_megatron_logits, test_families_from_hf, test_hf_families)."""

from __future__ import annotations

import dataclasses

import torch

from mindspeed.megatron.config import ParallelSizes, transformer_config
from mindspeed.metrics.flops import forward_flops_per_token
from mindspeed.model.shape import ModelShape
from mindspeed.ops.norms import rms_norm_reference

SHAPE = ModelShape(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    vocab_size=64,
    swiglu=False,
    geglu=True,
    apply_layernorm_1p=True,
    query_pre_attn_scalar=32,
    window_size=(3, 0),
    window_attn_skip_freq=(1, 1, 0, 1),
)


def test_config_carries_the_gemma_fields() -> None:
    config = transformer_config(SHAPE, ParallelSizes())
    assert config.layernorm_zero_centered_gamma and config.gated_linear_unit
    assert config.softmax_scale == 32**-0.5
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == [1, 1, 0, 1]
    x = torch.randn(5)
    torch.testing.assert_close(config.activation_func(x), torch.nn.functional.gelu(x, approximate="tanh"))


def test_zero_centered_norm_scales_by_one_plus_weight() -> None:
    from mindspeed.megatron.modules import RegistryNorm

    norm = RegistryNorm(transformer_config(SHAPE, ParallelSizes()), 32, eps=1e-6, impl="reference")
    assert torch.equal(norm.weight, torch.zeros(32)), "(1 + w) norms start at w = 0"
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 32)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, 1 + norm.weight, 1e-6), atol=0, rtol=0)


def test_window_applies_to_the_layers_window_attn_skip_freq_picks() -> None:
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed.megatron.modules import RegistryAttention

    config = transformer_config(SHAPE, ParallelSizes())
    windows = [
        RegistryAttention(config, number, AttnMaskType.causal, "self", impl="reference").window_size
        for number in range(1, 5)  # megatron's layer numbers are 1-based
    ]
    assert windows == [(3, 0), (3, 0), (-1, -1), (3, 0)]


def test_geglu_counts_three_mlp_matrices() -> None:
    swiglu = dataclasses.replace(SHAPE, swiglu=True, geglu=False)
    assert forward_flops_per_token(SHAPE, 16) == forward_flops_per_token(swiglu, 16)
