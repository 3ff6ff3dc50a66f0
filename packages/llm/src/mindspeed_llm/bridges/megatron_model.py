"""Build the megatron-core ``GPTModel`` a :class:`ModelShape` describes, on a parallel layout.

The converted checkpoints load into exactly this model (the tests load them strictly and compare
logits with transformers); training from a converted checkpoint builds its model the same way.
Needs megatron-core adapted (``mindspeed.megatron.adapt()``) and its parallel state initialised
for ``layout``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed.megatron.config import ParallelSizes, transformer_config
from mindspeed.megatron.dualpipev import local_embedding_groups, mirrored_groups
from mindspeed.patching import PatchSet, UpstreamPatch
from mindspeed_llm.bridges.layout import ParallelLayout
from mindspeed_llm.bridges.shape import ModelShape


def padded_vocab_size(shape: ModelShape, layout: ParallelLayout) -> int:
    """Embedding rows in megatron: the vocabulary padded to a multiple of the tensor-parallel size."""
    return -(-shape.vocab_size // layout.tp) * layout.tp


def parallel_sizes(shape: ModelShape, layout: ParallelLayout) -> ParallelSizes:
    """The core's :class:`ParallelSizes` of a checkpoint layout (megatron refuses MoE with tensor
    parallelism unless activations are sequence-parallel, so MoE at TP > 1 gets it)."""
    if layout.num_layer_list:
        raise ValueError("building a model with --num-layer-list is not supported; use equal pipeline stages")
    return ParallelSizes(
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        vpp=layout.num_chunks(shape) if layout.vpp_layers else None,
        sequence_parallel=bool(shape.num_experts) and layout.tp > 1,
    )


def _layer_spec(
    shape: ModelShape,
    num_experts: int | None,
    impls: Mapping[str, str] | None,
    megatron_modules: bool,
    moe_grouped_gemm: bool | None = None,
) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mindspeed.megatron.spec import MindSpeedSpecProvider, get_gpt_layer_spec
    from mindspeed.megatron.variants import apply_layer_variants

    if has_layer_variants(shape):
        # Gemma-style layers: registry norms ((1 + w) is not in megatron's local norms), with the
        # variant modules megatron's spec lacks (same parameter names either way).
        spec = get_gpt_layer_spec(
            impls=impls,
            num_experts=num_experts,
            qk_layernorm=shape.qk_layernorm,
            normalization=shape.normalization,
            swiglu=shape.swiglu,
            moe_grouped_gemm=moe_grouped_gemm,
            alibi=shape.position_embedding_type == "alibi",
        )
        norm = MindSpeedSpecProvider(impls).layer_norm(rms_norm=shape.normalization == "RMSNorm")
        return apply_layer_variants(spec, shape, norm)
    if not shape.multi_latent_attention:
        # Attention sinks exist only in the registry attention off CUDA (megatron's allocates them there).
        if megatron_modules and not shape.softmax_sinks:
            return get_gpt_layer_local_spec(
                num_experts=num_experts, qk_layernorm=shape.qk_layernorm, normalization=shape.normalization
            )
        return get_gpt_layer_spec(
            impls=impls,
            num_experts=num_experts,
            qk_layernorm=shape.qk_layernorm,
            normalization=shape.normalization,
            swiglu=shape.swiglu,
            moe_grouped_gemm=moe_grouped_gemm,
            alibi=shape.position_embedding_type == "alibi",
        )
    # MLA: megatron's local spec (its q/kv norms need qk_layernorm), with a core attention that
    # takes MLA's distinct value width; norms and activation from the registry unless asked not to.
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=True, multi_latent_attention=True, normalization="RMSNorm"
    )
    provider = MindSpeedSpecProvider(impls)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(module=mla_core_attention(), params={"impl": provider.impls["attention"]})
    if not megatron_modules:
        norm = provider.layer_norm(rms_norm=True)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        attention.q_layernorm = attention.kv_layernorm = norm
        mlp = spec.submodules.mlp.submodules
        for target in [mlp] + [
            getattr(mlp, name) for name in ("experts", "shared_experts") if getattr(mlp, name, None)
        ]:
            subs = getattr(target, "submodules", target)
            if hasattr(subs, "activation_func"):
                subs.activation_func = provider.activation_func()
    return spec


def with_gated_delta_net(spec: Any, impls: Mapping[str, str] | None) -> Any:
    """A copy of layer ``spec`` whose token mixer is megatron's Gated DeltaNet on the registry
    (:class:`mindspeed.megatron.gated_delta_net.RegistryGatedDeltaNet`, the ``gated_delta_rule``
    kernel ``impls`` chooses) instead of softmax attention; norms and MLP stay as they are."""
    from mindspeed.megatron.gated_delta_net import get_registry_gated_delta_net_spec
    from mindspeed.megatron.spec import MindSpeedSpecProvider

    impl = MindSpeedSpecProvider(impls).kernels.kernel_for("gated_delta_rule")
    linear = copy.copy(spec)
    linear.submodules = copy.copy(spec.submodules)
    linear.submodules.self_attention = get_registry_gated_delta_net_spec(impls, impl)
    return linear


def has_layer_variants(shape: ModelShape) -> bool:
    """Whether ``shape`` needs :mod:`mindspeed.megatron.variants` (Gemma-style layers)."""
    return shape.post_norm or shape.apply_layernorm_1p or shape.local_rotary_base is not None


def mla_without_te_patch() -> Any:
    """megatron-core 0.16's ``MLASelfAttention`` tests ``isinstance(linear_proj, TELinear)`` whenever
    its Transformer Engine import succeeded, which on installs without Transformer Engine gives a
    mock class and a TypeError; while models are built, this tells it Transformer Engine is absent."""
    import importlib.util

    return UpstreamPatch(
        name="mla-no-te-probe",
        target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
        make=lambda original, accelerator: False,
        distribution="megatron-core",
        versions=">=0.16.0,<0.17",
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

        def __init__(
            self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if attention_bias is not None:
                raise ValueError("MLARegistryAttention does not support attention_bias")
            width = value.shape[-1]
            if width != key.shape[-1]:
                value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            if packed_seq_params is not None:  # THD: [t, heads, dim] in, [t, heads * width] out
                out = self._attend_packed(query, key, value, packed_seq_params, causal)
                return out.view(query.shape[0], query.shape[1], -1)[..., :width].reshape(query.shape[0], -1)
            out = self.kernel(
                query.transpose(0, 1),
                key.transpose(0, 1),
                value.transpose(0, 1),
                causal=causal,
                softmax_scale=self.softmax_scale,
                window_size=self.window_size,
            )[..., :width]
            return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    return MLARegistryAttention


def _block_spec(
    config: Any, layer_specs: list[Any], vp_stage: int | None, pp_rank: int | None = None, final_norm: Any = None
) -> Any:
    # This chunk's slice of the per-layer specs (dense and MoE layers mixed), the way megatron's
    # get_gpt_decoder_block_spec cuts it, with megatron's default final norm (or ``final_norm``).
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=layer_specs[offset : offset + count], layer_norm=final_norm or LayerNormImpl
    )


def build_gpt_chunks(
    shape: ModelShape,
    layout: ParallelLayout | ParallelSizes,
    impls: Mapping[str, str] | None = None,
    vocab_size: int | None = None,
    megatron_modules: bool = False,
    transformer: Any = None,
    moe_grouped_gemm: bool | None = None,
    groups: Any = None,
    dualpipev: bool = False,
    **overrides: Any,
) -> list[Any]:
    """This rank's bare ``GPTModel`` chunks (one per virtual pipeline stage) for ``shape`` on ``layout``.

    The one place a megatron ``GPTModel`` is put together from a shape: converted checkpoints
    load into it, and the trainer and the RL actor wrap it (:func:`mindspeed_llm.training.model.build_model`).

    Args:
        shape: the model.
        layout: the layout megatron's parallel state was initialised with (a checkpoint's
            :class:`ParallelLayout` or the core's :class:`ParallelSizes`).
        impls: registry kernel choices for ``get_gpt_layer_spec`` (e.g. all ``"reference"``).
        vocab_size: embedding rows (default: the vocabulary padded to a multiple of TP).
        megatron_modules: build megatron's own local spec instead of the registry kernels (same
            parameters; for checkpoint I/O: megatron's ``sharded_state_dict`` walks every module).
        transformer: the ``TransformerConfig`` to build with (default: the core builder's for
            ``shape`` on ``layout`` with ``overrides``).
        moe_grouped_gemm: experts as one grouped GEMM (``None``: the ``moe_grouped_gemm`` feature decides).
        groups: the process groups (a ``ProcessGroupCollection``) given to ``GPTModel`` and deciding
            the pipeline stages (``None``: megatron's parallel state).
        dualpipev: build DualPipeV's V (``mindspeed.megatron.dualpipev``): two chunks per rank,
            the second one numbered as megatron's virtual stage 1 of the mirrored rank (needs
            ``groups`` and a ``transformer`` with ``virtual_pipeline_model_parallel_size=2``).
        **overrides: extra ``TransformerConfig`` fields (without ``transformer``).
    """
    sizes = layout if isinstance(layout, ParallelSizes) else parallel_sizes(shape, layout)
    if transformer is None:
        if megatron_modules:
            overrides.setdefault("use_te_activation_func", False)
        # The dispatcher the converted checkpoints were proven with (logits equal transformers').
        overrides.setdefault("moe_token_dispatcher_type", "allgather")
        transformer = transformer_config(shape, sizes, **overrides)
    dense = _layer_spec(shape, None, impls, megatron_modules, moe_grouped_gemm)
    moe = _layer_spec(shape, shape.num_experts, impls, megatron_modules, moe_grouped_gemm)
    grid = (getattr(transformer, "tp_x", 1), getattr(transformer, "tp_y", 1))
    if grid != (1, 1):  # the tp_2d feature: 2D linears and norms in the dense layers
        from mindspeed.megatron.tp2d import apply_tp2d

        if shape.num_experts:
            raise ValueError("2D tensor parallelism covers dense models; turn the tp_2d feature off for MoE")
        dense = apply_tp2d(dense, *grid)
    layer_specs = [moe if shape.is_moe_layer(i) else dense for i in range(shape.num_layers)]
    if shape.linear_attention_freq:
        linear = {id(spec): with_gated_delta_net(spec, impls) for spec in (dense, moe)}
        layer_specs = [linear[id(spec)] if shape.is_linear_layer(i) else spec for i, spec in enumerate(layer_specs)]
    rows = vocab_size or -(-shape.vocab_size // sizes.tp) * sizes.tp
    patches = PatchSet([mla_without_te_patch()] if shape.multi_latent_attention else [])
    patches.apply(get_accelerator())
    try:
        if dualpipev:
            chunks = _build_v_chunks(shape, sizes, transformer, layer_specs, rows, groups, impls)
        else:
            chunks = [
                _build_chunk(shape, sizes, transformer, layer_specs, stage, rows, groups, impls)
                for stage in range(sizes.vpp or 1)
            ]
    finally:
        patches.revert()
    if grid != (1, 1):
        from mindspeed.megatron.tp2d import install_tp2d_boundaries

        install_tp2d_boundaries(chunks)
    return chunks


def _build_v_chunks(
    shape: ModelShape,
    sizes: ParallelSizes,
    config: Any,
    layer_specs: list[Any],
    vocab_size: int,
    groups: Any,
    impls: Mapping[str, str] | None,
) -> list[Any]:
    # DualPipeV's V: chunk 0 is megatron's virtual stage 0 of this rank (the embedding on rank 0),
    # chunk 1 its virtual stage 1 of the mirrored rank (the loss on rank 0).
    if groups is None or config.virtual_pipeline_model_parallel_size != 2:
        raise ValueError("dualpipev chunks need the process groups and virtual_pipeline_model_parallel_size=2")
    sizes = dataclasses.replace(sizes, vpp=2)
    first = groups.pp.rank() == 0
    # Rank 0 holds both the embedding (chunk 0) and the output layer (chunk 1): there is no
    # embedding group between stages (megatron's would pair rank 0 with rank P-1, which holds neither).
    groups = local_embedding_groups(groups)
    chunks = [
        _build_chunk(shape, sizes, config, layer_specs, 0, vocab_size, groups, impls, (first, False)),
        _build_chunk(shape, sizes, config, layer_specs, 1, vocab_size, mirrored_groups(groups), impls, (False, first)),
    ]
    if first and shape.tie_embeddings:
        # megatron zeroes the output layer's copy of a tied embedding and fills it by an all-reduce
        # over the embedding group; here the copy is local (dualpipev.sum_tied_embedding_grads keeps it tied).
        embedding, output = (chunk.shared_embedding_or_output_weight() for chunk in chunks)
        with torch.no_grad():
            output.copy_(embedding)
    return chunks


def _build_chunk(
    shape: ModelShape,
    sizes: ParallelSizes,
    config: Any,
    layer_specs: list[Any],
    stage: int,
    vocab_size: int,
    groups: Any = None,
    impls: Mapping[str, str] | None = None,
    ends: tuple[bool, bool] | None = None,
) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )

    from mindspeed.megatron.spec import MindSpeedSpecProvider
    from mindspeed.megatron.variants import add_model_variants

    vp_stage = stage if sizes.vpp else None
    if groups is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        extra = {}
    else:
        pre_process = is_pp_first_stage(groups.pp) and is_vp_first_stage(vp_stage, sizes.vpp)
        post_process = is_pp_last_stage(groups.pp) and is_vp_last_stage(vp_stage, sizes.vpp)
        extra = {"pg_collection": groups}
    if ends is not None:  # set by the caller (DualPipeV's V)
        pre_process, post_process = ends
    final_norm = None
    if shape.apply_layernorm_1p:  # megatron's local norms have no (1 + w)
        final_norm = MindSpeedSpecProvider(impls).layer_norm(rms_norm=shape.normalization == "RMSNorm")
    block = _block_spec(config, layer_specs, vp_stage, None if groups is None else groups.pp.rank(), final_norm)
    mtp = None
    if shape.mtp_num_layers:
        # megatron's own helper: on the last stage (the last chunk), MTP layers built like the last
        # decoder layer, with its local norms and projection; None on the other stages.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        last = TransformerBlockSubmodules(layer_specs=[layer_specs[-1]])
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp,
        vocab_size=vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        # ALiBi lives in the core attention (the layer spec); the model adds no position embedding.
        position_embedding_type="none" if shape.position_embedding_type == "alibi" else shape.position_embedding_type,
        rotary_base=int(shape.rotary_base) if float(shape.rotary_base).is_integer() else shape.rotary_base,
        rotary_percent=shape.rotary_percent,
        rope_scaling=shape.use_rope_scaling,
        rope_scaling_factor=shape.rope_scaling_factor,
        seq_len_interpolation_factor=shape.rotary_seq_len_interpolation_factor,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        vp_stage=vp_stage,
        **extra,
    )
    norm = MindSpeedSpecProvider(impls).layer_norm(rms_norm=shape.normalization == "RMSNorm")
    return add_model_variants(model, shape, norm)
