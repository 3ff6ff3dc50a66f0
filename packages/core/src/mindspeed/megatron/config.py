"""The one builder of megatron-core's ``TransformerConfig``: from a :class:`ModelShape` and a layout.

Every megatron model of the project is configured here: the LLM trainer, the bridges' models
(checkpoint conversion, training from Hugging Face, the RL actor) and the core's tiny test GPT.
What is a property of the model comes from the shape; what is a property of the run (dropout,
recompute, auxiliary losses, the dispatcher, features' settings) is passed as ``overrides``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mindspeed.features.tp2d import TP2D_FIELDS
from mindspeed.model.shape import ModelShape

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelSizes:
    """A parallel layout; the data-parallel size is what the world size leaves over.

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        vpp: virtual pipeline stages per rank (``None``: no interleaving).
        ep: expert-parallel size.
        sequence_parallel: shard activations along the sequence in the tensor-parallel region.
        etp: expert-tensor-parallel size (``None``: megatron's default, the tensor-parallel size).
        cp: context-parallel size.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None
    cp: int = 1

    @property
    def name(self) -> str:
        """Short label, e.g. ``tp2-sp`` or ``pp2-vpp2``."""
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        return "-".join(parts) or "single"


def torch_dtype(shape: ModelShape) -> torch.dtype:
    """The torch dtype of ``shape.params_dtype``."""
    return _DTYPES[shape.params_dtype]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (transformers' ``gelu_pytorch_tanh``, Gemma's GeGLU gate)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _activation(shape: ModelShape) -> Any:
    if shape.swiglu:
        return torch.nn.functional.silu
    if shape.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    return gelu_tanh if shape.geglu or shape.gelu_tanh else torch.nn.functional.gelu


def expert_tensor_parallel_size(shape: ModelShape, etp: int | None) -> int | None:
    """The expert-tensor-parallel size for ``shape`` given the asked one (``None``: megatron's default, TP).

    megatron's experts take biases (GPT-OSS) only unsplit by tensor parallelism: such models get 1.

    Raises:
        ValueError: another size is asked for a model with expert biases.
    """
    if not (shape.num_experts and shape.add_bias_linear):
        return etp
    if etp not in (None, 1):
        raise ValueError(f"expert_tensor_parallel_size {etp}: experts with biases need 1 (megatron's limit); set etp=1")
    return 1


#: ``TransformerConfig`` attributes that are not megatron fields: the ``context_parallel``
#: feature's double-ring window and adaptive CP, read by ``RegistryAttention``; the ``tp_2d``
#: feature's grid, read by the model builder (``mindspeed.megatron.tp2d``).
EXTRA_CONFIG_ATTRIBUTES = ("cp_window_size", "cp_adaptive", *TP2D_FIELDS)


def transformer_config(shape: ModelShape, sizes: ParallelSizes, **overrides: Any) -> Any:
    """The megatron ``TransformerConfig`` (``MLATransformerConfig`` for MLA) of ``shape`` on ``sizes``.

    Args:
        shape: the model.
        sizes: the parallel layout.
        **overrides: run settings and extra fields, applied last (``hidden_dropout``,
            ``recompute_granularity``, ``moe_token_dispatcher_type``, ``moe_aux_loss_coeff`` ...).

    Defaults that are not the model's: no dropout, weights initialised in full on the host and
    then sliced (a tensor-parallel model equals the single-rank one of the same seed), no fused
    kernels from Apex or Transformer Engine, MoE with the ``alltoall`` dispatcher and no
    auxiliary loss.
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = torch_dtype(shape)
    fields: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        layernorm_epsilon=shape.norm_epsilon,
        normalization=shape.normalization,
        gated_linear_unit=shape.swiglu or shape.geglu or shape.quick_geglu,
        glu_linear_offset=shape.glu_linear_offset,
        activation_func_clamp_value=shape.activation_clamp,
        softmax_type="learnable" if shape.softmax_sinks else "vanilla",
        activation_func=_activation(shape),
        # The registry SwiGLU is reached through this flag; no Transformer Engine is involved.
        use_te_activation_func=shape.swiglu,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        add_bias_linear=shape.add_bias_linear,
        add_qkv_bias=shape.add_qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        layernorm_zero_centered_gamma=shape.apply_layernorm_1p,
        softmax_scale=shape.softmax_scale,
        window_size=shape.window_size,
        window_attn_skip_freq=list(shape.window_attn_skip_freq) if shape.window_attn_skip_freq else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        sequence_parallel=sizes.sequence_parallel,
        context_parallel_size=sizes.cp,
    )
    if shape.mtp_num_layers:
        fields["mtp_num_layers"] = shape.mtp_num_layers
    if shape.attention_output_gate:
        fields["attention_output_gate"] = True
    if shape.linear_attention_freq:  # Gated DeltaNet layers (mindspeed.megatron.gated_delta_net)
        fields.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=list(shape.linear_attention_freq),
            linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
            linear_key_head_dim=shape.linear_key_head_dim,
            linear_value_head_dim=shape.linear_value_head_dim,
            linear_num_key_heads=shape.linear_num_key_heads,
            linear_num_value_heads=shape.linear_num_value_heads,
        )
    if shape.num_experts:  # expert-parallel sizes mean nothing (and megatron refuses them) without experts
        fields["expert_model_parallel_size"] = sizes.ep
        etp = expert_tensor_parallel_size(shape, sizes.etp)
        if etp is not None:
            fields["expert_tensor_parallel_size"] = etp
        fields.update(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk,
            moe_layer_freq=list(shape.moe_layer_freq),
            moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=shape.moe_shared_expert_gate,
            moe_router_enable_expert_bias=shape.moe_router_enable_expert_bias,
            moe_router_score_function=shape.moe_router_score_function,
            moe_router_pre_softmax=shape.moe_router_pre_softmax,
            moe_router_num_groups=shape.moe_router_num_groups,
            moe_router_group_topk=shape.moe_router_group_topk,
            moe_router_topk_scaling_factor=shape.moe_router_topk_scaling_factor,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
        )
    cls = TransformerConfig
    if shape.multi_latent_attention:
        cls = MLATransformerConfig
        fields.update(
            multi_latent_attention=True,
            q_lora_rank=shape.q_lora_rank,
            kv_lora_rank=shape.kv_lora_rank,
            qk_head_dim=shape.qk_head_dim,
            qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
            v_head_dim=shape.v_head_dim,
            rotary_base=shape.rotary_base,
            rope_type=shape.rope_type,
            rotary_scaling_factor=shape.rotary_scaling_factor,
            mscale=shape.mscale,
            mscale_all_dim=shape.mscale_all_dim,
            beta_fast=shape.beta_fast,
            beta_slow=shape.beta_slow,
            original_max_position_embeddings=shape.original_max_position_embeddings,
        )
    fields.update(overrides)
    # MindSpeed settings megatron's TransformerConfig has no field for: set as attributes (the
    # layers read them with getattr, as GPTModel reads the YaRN ones below).
    extra = {name: fields.pop(name) for name in EXTRA_CONFIG_ATTRIBUTES if name in fields}
    config = cls(**fields)
    for name, value in extra.items():
        setattr(config, name, value)
    if shape.position_embedding_type == "yarn" and not shape.multi_latent_attention:
        # GPTModel reads its YaRN settings with getattr (TransformerConfig has no such fields).
        config.yarn_rotary_scaling_factor = shape.rotary_scaling_factor
        config.yarn_original_max_position_embeddings = shape.original_max_position_embeddings
        config.yarn_beta_fast, config.yarn_beta_slow = shape.beta_fast, shape.beta_slow
        config.yarn_mscale, config.yarn_mscale_all_dim = shape.mscale, shape.mscale_all_dim
        config.yarn_correction_range_round_to_int = shape.yarn_truncate
    return config
