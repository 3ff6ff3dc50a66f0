"""The one description of a GPT model: :class:`ModelShape`, from which every other view is derived.

:class:`ModelShape` holds what decides the names and shapes of a megatron-core ``GPTModel``'s
parameters (local spec): sizes, attention variant, MoE layout, multi-token prediction. Its field
names are megatron's argument names, so it is written into and read back from the ``args`` of a
Megatron checkpoint without a translation table. Everything else is derived from it:

- the megatron ``TransformerConfig``: :func:`mindspeed.megatron.config.transformer_config`;
- the FLOPs of MFU: :func:`mindspeed.metrics.flops.forward_flops_per_token`;
- the tiny test models of the core (:mod:`mindspeed.testing.megatron`, :mod:`mindspeed.testing.tiny_llama`);
- in the LLM suite, the bridges' Hugging Face configs and the inference decoder.

Importing this module imports neither megatron nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes and variants of a GPT model, with megatron's argument names.

    Attributes:
        num_layers: transformer layers.
        hidden_size: model width.
        ffn_hidden_size: width of the dense MLP.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA groups; default: as many as query heads).
        kv_channels: width of one attention head (default ``hidden_size // num_attention_heads``).
        vocab_size: rows of the embedding in the Hugging Face checkpoint.
        max_position_embeddings: longest sequence of the rotary tables.
        norm_epsilon: epsilon of every RMSNorm.
        rotary_base: rope theta.
        rotary_percent: fraction of each head's channels that rotate (the first
            ``kv_channels * rotary_percent``; the rest pass through; GLM-4.5's 0.5). megatron's
            ``--rotary-percent``, transformers' ``rope_parameters['partial_rotary_factor']``.
        use_rope_scaling: Llama 3.1's rope frequency scaling (megatron's ``--use-rope-scaling``).
        rope_scaling_factor: its factor.
        untie_embeddings_and_output_weights: the output layer has its own weights.
        add_qkv_bias: the fused QKV projection has a bias.
        qk_layernorm: queries and keys are RMS-normalised per head (Qwen3).
        normalization: ``RMSNorm`` or ``LayerNorm``.
        swiglu: gated SiLU MLP (three matrices); false: a plain GeLU MLP (two).
        geglu: gated MLP with the tanh-approximated GeLU (Gemma; with ``swiglu`` false).
        gelu_tanh: the plain (not gated) MLP's GeLU is tanh-approximated (BLOOM).
        embedding_layernorm: the word embeddings are normalised before the first layer (BLOOM's
            ``word_embeddings_layernorm``; a norm of ``normalization``'s kind).
        apply_layernorm_1p: every norm scales by ``1 + weight`` (weights zero-centred; Gemma).
        post_norm: attention and MLP outputs are normalised before the residual add (Gemma's
            ``post_attention_layernorm`` / ``post_feedforward_layernorm``).
        embedding_multiplier_scale: the embedding output is multiplied by this (Gemma:
            ``sqrt(hidden_size)``; ``None``: not scaled).
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
            instead of ``kv_channels ** -0.5`` (``None``: the default).
        window_size: sliding-window attention ``(left, right)`` (``None``: full attention).
        window_attn_skip_freq: one flag per layer, 1 for the layers that use ``window_size``
            (``None`` with a window: every layer).
        local_rotary_base: rope theta of the sliding-window layers (``None``: ``rotary_base``).
        rotary_seq_len_interpolation_factor: linear rope scaling of the other layers (positions
            divided by it; ``None``: none).
        output_logit_softcapping: logits become ``cap * tanh(logits / cap)`` (``None``: off).
        softmax_sinks: every attention head has a learnable sink logit, one more softmax column
            whose probability is dropped (GPT-OSS; megatron's ``softmax_type='learnable'``).
        quick_geglu: the gated MLP's gate is ``x * sigmoid(1.702 x)`` (megatron's ``quick_gelu``;
            GPT-OSS's SwiGLU with its alpha), with ``swiglu`` false.
        glu_linear_offset: the gated MLP multiplies by ``up + offset`` (GPT-OSS: 1).
        activation_clamp: the gate is clamped above and ``up`` on both sides at this value
            before the gated activation (GPT-OSS's ``swiglu_limit``; ``None``: no clamp).
        yarn_truncate: YaRN's correction range is rounded to whole dimensions (transformers'
            ``truncate``; GPT-OSS sets false), with ``position_embedding_type='yarn'``.
        add_bias_linear: biases in every linear layer.
        position_embedding_type: ``rope``, ``yarn`` (rope with YaRN scaling, the MLA fields
            below: ``rotary_scaling_factor`` ...), ``learned_absolute``, ``alibi`` (biases in
            attention, :mod:`mindspeed.ops.alibi`) or ``none``.
        num_experts: routed experts of MoE layers (``None``: dense model).
        moe_ffn_hidden_size: width of one routed expert.
        moe_router_topk: experts per token.
        moe_layer_freq: one flag per layer, 1 for MoE layers, 0 for dense ones.
        moe_shared_expert_intermediate_size: width of the shared experts (``None``: none).
        moe_shared_expert_gate: the shared experts' output is scaled by a learned sigmoid gate
            (Qwen2-MoE's ``shared_expert_gate``).
        moe_router_enable_expert_bias: the router has a per-expert score bias (DeepSeek-V3).
        moe_router_score_function: ``softmax`` or ``sigmoid``.
        moe_router_pre_softmax: softmax over all experts before top-k (no renormalisation).
        moe_router_num_groups: expert groups of group-limited routing (``None``: off).
        moe_router_group_topk: groups chosen per token.
        moe_router_topk_scaling_factor: scale of the routing weights (``None``: 1).
        multi_latent_attention: DeepSeek's MLA instead of grouped-query attention.
        q_lora_rank: rank of MLA's query down-projection (``None``: a full query projection).
        kv_lora_rank: rank of MLA's key/value down-projection.
        qk_head_dim: MLA query/key width without the rotary part.
        qk_pos_emb_head_dim: MLA rotary width.
        v_head_dim: MLA value width.
        rope_type: MLA rotary variant, ``rope`` or ``yarn`` (with the five fields below).
        rotary_scaling_factor: YaRN factor.
        mscale: YaRN mscale.
        mscale_all_dim: YaRN mscale_all_dim.
        beta_fast: YaRN beta_fast.
        beta_slow: YaRN beta_slow.
        original_max_position_embeddings: YaRN's original context length.
        attention_output_gate: the query projection also emits a per-channel gate; the attention
            output is multiplied by its sigmoid before the output projection (Qwen3-Next's gated
            attention; megatron's ``attention_output_gate``).
        linear_attention_freq: one flag per layer, 1 for the Gated DeltaNet (linear-attention)
            layers, 0 for softmax-attention ones (``None``: no linear layers; megatron's
            ``linear_attention_freq`` list with ``experimental_attention_variant='gated_delta_net'``).
        linear_conv_kernel_dim: width of the linear layers' causal depthwise convolution.
        linear_key_head_dim: width of a linear layer's query/key head.
        linear_value_head_dim: width of its value head.
        linear_num_key_heads: its query/key heads.
        linear_num_value_heads: its value heads (a multiple of the key heads).
        mtp_num_layers: multi-token-prediction layers after the decoder (``None``: none); each is
            a transformer layer of the last decoder layer's kind (megatron's ``--mtp-num-layers``).
        params_dtype: dtype of the weights ("float32", "bfloat16", "float16").
        num_labels: the output layer is a classification / score head of this many rows
            (transformers' ``*ForSequenceClassification`` ``score``; 1 for a reward model or a
            critic) instead of the language-model head (``None``).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    untie_embeddings_and_output_weights: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    normalization: str = "RMSNorm"
    swiglu: bool = True
    geglu: bool = False
    gelu_tanh: bool = False
    embedding_layernorm: bool = False
    apply_layernorm_1p: bool = False
    post_norm: bool = False
    embedding_multiplier_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: tuple[int, ...] | None = None
    local_rotary_base: float | None = None
    rotary_seq_len_interpolation_factor: float | None = None
    output_logit_softcapping: float | None = None
    softmax_sinks: bool = False
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_clamp: float | None = None
    yarn_truncate: bool = True
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_layer_freq: tuple[int, ...] | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    attention_output_gate: bool = False
    linear_attention_freq: tuple[int, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    mtp_num_layers: int | None = None
    params_dtype: str = "float32"
    num_labels: int | None = None

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_experts and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        if not self.num_experts:
            object.__setattr__(self, "num_experts", None)
        if not self.mtp_num_layers:
            object.__setattr__(self, "mtp_num_layers", None)
        if self.num_experts and self.moe_layer_freq is None:
            object.__setattr__(self, "moe_layer_freq", (1,) * self.num_layers)
        for name in ("window_size", "window_attn_skip_freq", "linear_attention_freq"):
            if getattr(self, name) is not None:  # lists from a checkpoint's args
                object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.window_attn_skip_freq is not None and len(self.window_attn_skip_freq) != self.num_layers:
            raise ValueError(
                f"window_attn_skip_freq has {len(self.window_attn_skip_freq)} entries for {self.num_layers} layers"
            )
        if self.linear_attention_freq is not None and len(self.linear_attention_freq) != self.num_layers:
            raise ValueError(
                f"linear_attention_freq has {len(self.linear_attention_freq)} entries for {self.num_layers} layers"
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.moe_layer_freq is not None:
            object.__setattr__(self, "moe_layer_freq", tuple(int(x) for x in self.moe_layer_freq))
            if len(self.moe_layer_freq) != self.num_layers:
                raise ValueError(f"moe_layer_freq has {len(self.moe_layer_freq)} entries for {self.num_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) has routed experts."""
        return bool(self.num_experts and self.moe_layer_freq and self.moe_layer_freq[layer])

    def is_linear_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) is a Gated DeltaNet (linear-attention) layer."""
        return bool(self.linear_attention_freq and self.linear_attention_freq[layer])

    def is_window_layer(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) attends within ``window_size`` (megatron's rule)."""
        if self.window_size is None:
            return False
        return self.window_attn_skip_freq is None or bool(self.window_attn_skip_freq[layer])

    @property
    def rotary_dim(self) -> int:
        """Channels of a (non-MLA) head that rotate: ``kv_channels * rotary_percent``, as megatron
        and transformers both round it (``int``)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def softmax_scale(self) -> float | None:
        """The attention's score scale when it is not ``kv_channels ** -0.5`` (``None``)."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's cos/sin scale (megatron's attention reads it from the config's ``yarn_*`` fields):
        ``m(factor, mscale) / m(factor, mscale_all_dim)`` with
        ``m(s, a) = 0.1 * a * ln(s) + 1`` (1 when ``s <= 1``), as transformers and megatron compute it."""

        def m(scale: float, amount: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * amount * math.log(scale) + 1.0

        return m(self.rotary_scaling_factor, self.mscale) / m(self.rotary_scaling_factor, self.mscale_all_dim)

    @property
    def mtp_is_moe(self) -> bool:
        """Whether the multi-token-prediction layers have routed experts (megatron builds them
        with the last decoder layer's spec)."""
        return self.is_moe_layer(self.num_layers - 1)

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def tie_embeddings(self) -> bool:
        """The output layer reuses the embedding."""
        return not self.untie_embeddings_and_output_weights

    def to_args(self) -> dict[str, Any]:
        """The megatron arguments this shape implies (plain values, for a checkpoint's ``args``)."""
        args = dataclasses.asdict(self)
        args["moe_layer_freq"] = list(self.moe_layer_freq) if self.moe_layer_freq else 1
        for name in ("window_size", "window_attn_skip_freq", "linear_attention_freq"):
            if args[name] is not None:
                args[name] = list(args[name])
        args.update(
            group_query_attention=self.num_query_groups != self.num_attention_heads,
            rotary_interleaved=False,
            use_rotary_position_embeddings=self.position_embedding_type in ("rope", "yarn"),
            add_position_embedding=self.position_embedding_type == "learned_absolute",
            moe_grouped_gemm=False,
            bf16=self.params_dtype == "bfloat16",
            fp16=self.params_dtype == "float16",
        )
        return args

    @classmethod
    def from_args(cls, args: argparse.Namespace | dict[str, Any]) -> ModelShape:
        """The shape recorded in a Megatron checkpoint's ``args``.

        Raises:
            ValueError: a required field (``num_layers``, ``hidden_size`` ...) is missing.
        """
        values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in values.items() if k in names and v is not None}
        if "params_dtype" not in picked or not isinstance(picked["params_dtype"], str):
            picked["params_dtype"] = (
                "bfloat16" if values.get("bf16") else "float16" if values.get("fp16") else "float32"
            )
        if isinstance(picked.get("moe_layer_freq"), int):
            freq = picked.pop("moe_layer_freq")
            picked["moe_layer_freq"] = tuple(int(i % freq == 0) for i in range(picked.get("num_layers", 0)))
        if "num_query_groups" not in picked and "num_attention_heads" in picked:
            picked["num_query_groups"] = picked["num_attention_heads"]
        if "kv_channels" not in picked and "hidden_size" in picked and "num_attention_heads" in picked:
            picked["kv_channels"] = picked["hidden_size"] // picked["num_attention_heads"]
        if "vocab_size" not in picked and "padded_vocab_size" in values:
            picked["vocab_size"] = values["padded_vocab_size"]
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in picked]
        if missing:
            raise ValueError(
                f"the checkpoint's args lack {', '.join(missing)}; pass --hf-cfg-dir with the model's config.json"
            )
        return cls(**picked)
