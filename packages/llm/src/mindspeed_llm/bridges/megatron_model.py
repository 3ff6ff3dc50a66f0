"""Build the megatron-core ``GPTModel`` a :class:`ModelShape` describes, on a parallel layout.

The converted checkpoints load into exactly this model (the tests load them strictly and compare
logits with transformers); training from a converted checkpoint builds its model the same way.
Needs megatron-core adapted (``mindspeed.megatron.adapt()``) and its parallel state initialised
for ``layout``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.patching import PatchSet, UpstreamPatch
from mindspeed_llm.bridges.layout import ParallelLayout
from mindspeed_llm.bridges.shape import ModelShape

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(shape: ModelShape, layout: ParallelLayout) -> int:
    """Embedding rows in megatron: the vocabulary padded to a multiple of the tensor-parallel size."""
    return -(-shape.vocab_size // layout.tp) * layout.tp


def transformer_config(shape: ModelShape, layout: ParallelLayout, **overrides: Any) -> Any:
    """The megatron ``TransformerConfig`` (``MLATransformerConfig`` for MLA) of ``shape`` on ``layout``.

    Args:
        shape: the model.
        layout: the parallel layout (``num_layer_list`` is not supported here).
        **overrides: extra config fields.
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if layout.num_layer_list:
        raise ValueError("building a model with --num-layer-list is not supported; use equal pipeline stages")
    dtype = _DTYPES[shape.params_dtype]
    fields: dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, layernorm_epsilon=shape.norm_epsilon, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=shape.add_qkv_bias, qk_layernorm=shape.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
        # The registry SwiGLU is called through this flag; no Transformer Engine is involved.
        use_te_activation_func=True, bias_activation_fusion=False, apply_rope_fusion=False,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
        virtual_pipeline_model_parallel_size=layout.num_chunks(shape) if layout.vpp_layers else None,
    )
    if shape.mtp_num_layers:
        fields["mtp_num_layers"] = shape.mtp_num_layers
    if shape.num_experts:
        fields.update(
            num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk, moe_layer_freq=list(shape.moe_layer_freq),
            moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
            moe_router_enable_expert_bias=shape.moe_router_enable_expert_bias,
            moe_router_score_function=shape.moe_router_score_function,
            moe_router_pre_softmax=shape.moe_router_pre_softmax, moe_router_num_groups=shape.moe_router_num_groups,
            moe_router_group_topk=shape.moe_router_group_topk,
            moe_router_topk_scaling_factor=shape.moe_router_topk_scaling_factor,
            moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            # megatron refuses MoE with tensor parallelism unless activations are sequence-parallel.
            sequence_parallel=layout.tp > 1,
        )
    cls = TransformerConfig
    if shape.multi_latent_attention:
        cls = MLATransformerConfig
        fields.update(multi_latent_attention=True, q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank,
                      qk_head_dim=shape.qk_head_dim, qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
                      v_head_dim=shape.v_head_dim, rotary_base=shape.rotary_base, rope_type=shape.rope_type,
                      rotary_scaling_factor=shape.rotary_scaling_factor, mscale=shape.mscale,
                      mscale_all_dim=shape.mscale_all_dim, beta_fast=shape.beta_fast, beta_slow=shape.beta_slow,
                      original_max_position_embeddings=shape.original_max_position_embeddings)
    fields.update(overrides)
    return cls(**fields)


def _layer_spec(shape: ModelShape | Any, num_experts: int | None, impls: Mapping[str, str] | None,
                megatron_modules: bool) -> Any:
    # ``shape``: a ModelShape or a TransformerConfig (both name multi_latent_attention and qk_layernorm).
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mindspeed.megatron.spec import MindSpeedSpecProvider, get_gpt_layer_spec

    if not shape.multi_latent_attention:
        if megatron_modules:
            return get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=shape.qk_layernorm,
                                            normalization="RMSNorm")
        return get_gpt_layer_spec(impls=impls, num_experts=num_experts, qk_layernorm=shape.qk_layernorm)
    # MLA: megatron's local spec (its q/kv norms need qk_layernorm), with a core attention that
    # takes MLA's distinct value width; norms and activation from the registry unless asked not to.
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=True, multi_latent_attention=True,
                                    normalization="RMSNorm")
    provider = MindSpeedSpecProvider(impls)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(module=mla_core_attention(), params={"impl": provider.impls["attention"]})
    if not megatron_modules:
        norm = provider.layer_norm(rms_norm=True)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        attention.q_layernorm = attention.kv_layernorm = norm
        mlp = spec.submodules.mlp.submodules
        for target in [mlp] + [getattr(mlp, name) for name in ("experts", "shared_experts") if getattr(mlp, name, None)]:
            subs = getattr(target, "submodules", target)
            if hasattr(subs, "activation_func"):
                subs.activation_func = provider.activation_func()
    return spec


def mla_without_te_patch() -> Any:
    """megatron-core 0.16's ``MLASelfAttention`` tests ``isinstance(linear_proj, TELinear)`` whenever
    its Transformer Engine import succeeded, which on installs without Transformer Engine gives a
    mock class and a TypeError; while models are built, this tells it Transformer Engine is absent."""
    import importlib.util


    return UpstreamPatch(
        name="mla-no-te-probe", target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
        make=lambda original, accelerator: False, distribution="megatron-core", versions=">=0.16.0,<0.17",
        reason="isinstance() against a mocked TELinear without Transformer Engine",
        condition=lambda: importlib.util.find_spec("transformer_engine") is None,
    )


@functools.cache
def mla_core_attention() -> type:
    """The registry attention for MLA: accepts megatron's ``k_channels`` / ``v_channels`` and
    attends with values narrower than queries and keys (zero-padded, then cut back: exact), on
    padded batches or packed (THD) sequences."""
    # Lazy: keeps megatron out of the start-up of mindspeed_llm.cli.
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed.megatron.modules import RegistryAttention

    class MLARegistryAttention(RegistryAttention):
        """RegistryAttention taking MLA's head widths (values may be narrower than keys)."""

        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
            if attention_bias is not None:
                raise ValueError("MLARegistryAttention does not support attention_bias")
            width = value.shape[-1]
            if width != key.shape[-1]:
                value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            if packed_seq_params is not None:  # THD: [t, heads, dim] in, [t, heads * width] out
                out = self._attend_packed(query, key, value, packed_seq_params, causal)
                return out.view(query.shape[0], query.shape[1], -1)[..., :width].reshape(query.shape[0], -1)
            out = self.kernel(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), causal=causal,
                              softmax_scale=self.softmax_scale, window_size=self.window_size)[..., :width]
            return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    return MLARegistryAttention


def layer_specs(config: Any, impls: Mapping[str, str] | None = None) -> list[Any]:
    """One layer spec per decoder layer of a megatron ``TransformerConfig``: MLA or grouped-query
    attention, a dense MLP or experts as ``moe_layer_freq`` says (registry kernels; the trainer's
    path for DeepSeek-V3-like models)."""
    freq = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else \
        [int(i % config.moe_layer_freq == 0) for i in range(config.num_layers)]
    dense = _layer_spec(config, None, impls, False)
    moe = _layer_spec(config, config.num_moe_experts, impls, False) if config.num_moe_experts else dense
    return [moe if config.num_moe_experts and flag else dense for flag in freq]


def block_spec(config: Any, layer_specs: list[Any], vp_stage: int | None) -> Any:
    """This chunk's block spec: its slice of the per-layer specs (see :func:`layer_specs`)."""
    return _block_spec(config, layer_specs, vp_stage)


def _block_spec(config: Any, layer_specs: list[Any], vp_stage: int | None) -> Any:
    # This chunk's slice of the per-layer specs (dense and MoE layers mixed), the way megatron's
    # get_gpt_decoder_block_spec cuts it, with megatron's default final norm.
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + count], layer_norm=LayerNormImpl)


def build_gpt_chunks(shape: ModelShape, layout: ParallelLayout, impls: Mapping[str, str] | None = None,
                     vocab_size: int | None = None, megatron_modules: bool = False, **overrides: Any) -> list[Any]:
    """This rank's ``GPTModel`` chunks (one per virtual pipeline stage) for ``shape`` on ``layout``.

    Args:
        shape: the model.
        layout: the layout megatron's parallel state was initialised with.
        impls: registry kernel choices for ``get_gpt_layer_spec`` (e.g. all ``"reference"``).
        vocab_size: embedding rows (default: the vocabulary padded to a multiple of TP).
        megatron_modules: build megatron's own local spec instead of the registry kernels (same
            parameters; for checkpoint I/O: megatron's ``sharded_state_dict`` walks every module).
        **overrides: extra ``TransformerConfig`` fields.
    """
    if megatron_modules:
        overrides.setdefault("use_te_activation_func", False)
    config = transformer_config(shape, layout, **overrides)
    dense = _layer_spec(shape, None, impls, megatron_modules)
    moe = _layer_spec(shape, shape.num_experts, impls, megatron_modules)
    layer_specs = [moe if shape.is_moe_layer(i) else dense for i in range(shape.num_layers)]
    patches = PatchSet([mla_without_te_patch()] if shape.multi_latent_attention else [])
    patches.apply(get_accelerator())
    try:
        return [_build_chunk(shape, layout, config, layer_specs, stage, vocab_size) for stage in range(layout.num_chunks(shape))]
    finally:
        patches.revert()


def _build_chunk(shape: ModelShape, layout: ParallelLayout, config: Any, layer_specs: list[Any], stage: int,
                 vocab_size: int | None) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    vp_stage = stage if layout.vpp_layers else None
    block = _block_spec(config, layer_specs, vp_stage)
    mtp = None
    if shape.mtp_num_layers:
        # megatron's own helper: on the last stage (the last chunk), MTP layers built like the last
        # decoder layer, with its local norms and projection; None on the other stages.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        last = TransformerBlockSubmodules(layer_specs=[layer_specs[-1]])
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=block, mtp_block_spec=mtp,
        vocab_size=vocab_size or padded_vocab_size(shape, layout),
        max_sequence_length=shape.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(shape.rotary_base) if float(shape.rotary_base).is_integer() else shape.rotary_base,
        rope_scaling=shape.use_rope_scaling, rope_scaling_factor=shape.rope_scaling_factor,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=shape.tie_embeddings, vp_stage=vp_stage,
    )
