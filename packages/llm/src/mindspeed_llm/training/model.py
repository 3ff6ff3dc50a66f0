"""The megatron-core GPT of a :class:`PretrainConfig`, on this rank's part of the layout.

Built the way megatron's own training builds it: ``GPTModel`` chunks (one per virtual pipeline
stage) from the adaptor's registry spec (``mindspeed.megatron.spec.get_gpt_layer_spec``), cast
by ``Float16Module`` for bf16, wrapped in megatron's ``DistributedDataParallel``, with
``finalize_model_grads`` and ``no_sync`` set on the config (without them data-parallel ranks
silently diverge). Needs ``mindspeed.megatron.adapt()`` and megatron's parallel state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mindspeed.device import get_accelerator
from mindspeed_llm.training.config import PretrainConfig


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``lcm(divisible_by, tp)``.

    Megatron pads to a multiple of ``divisible_by * tp``, so the same tokenizer gets a different
    embedding at TP1 and TP2 and checkpoints do not move between them; the least common
    multiple gives every tensor-parallel size that divides ``divisible_by`` the same padding.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def transformer_config(config: PretrainConfig, vocab_size: int, overrides: Mapping[str, Any] | None = None) -> Any:
    """The megatron ``TransformerConfig`` of ``config`` (model shape, layout, precision).

    Args:
        config: the recipe.
        vocab_size: the tokenizer's vocabulary (not padded).
        overrides: fields set by features (``BuildContext.config_overrides``); the recipe's
            ``model.megatron`` entries are applied last and win.
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    m, p, t = config.model, config.parallel, config.train
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    fields: dict[str, Any] = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups or m.num_attention_heads,
        kv_channels=m.kv_channels, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        # The registry SwiGLU is reached through this flag; no Transformer Engine is involved.
        use_te_activation_func=m.swiglu, bias_activation_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout, attention_dropout=0.0, init_method_std=m.init_method_std,
        # Building every weight in full on the host and slicing it makes a tensor-parallel model
        # equal to the single-rank one of the same seed (and is what works without a device RNG).
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
        recompute_granularity=m.recompute_granularity,
    )
    if p.etp is not None:
        fields["expert_tensor_parallel_size"] = p.etp
    if config.stage != "pretrain":
        # Fine-tuning batches hold different numbers of trained tokens (and DPO pairs): the
        # gradients are divided by the step's total count, not averaged per microbatch.
        fields["calculate_per_token_loss"] = True
        if config.data.variable_seq_lengths and p.pp > 1:
            fields["variable_seq_lengths"] = True
    if m.recompute_granularity == "full":
        fields.update(recompute_method="uniform", recompute_num_layers=m.recompute_num_layers)
    if m.num_moe_experts:
        fields.update(num_moe_experts=m.num_moe_experts, moe_router_topk=m.moe_router_topk,
                      moe_ffn_hidden_size=m.moe_ffn_hidden_size or fields["ffn_hidden_size"],
                      moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_token_dispatcher_type=m.moe_token_dispatcher_type,
                      moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff else "none",
                      moe_grouped_gemm=False)
    del vocab_size  # the vocabulary lives in GPTModel, not in the TransformerConfig
    fields.update(overrides or {})
    fields.update(m.megatron)
    return (MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig)(**fields)


def default_groups() -> Any:
    """megatron's process groups of the initialised parallel state, as one value.

    The one read of megatron's ``parallel_state`` the builders need: a runner calls it once
    after ``initialize_model_parallel`` and passes the result (a ``ProcessGroupCollection``)
    to :func:`build_model`, the optimizer, the schedule and the metrics.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def build_model(config: PretrainConfig, transformer: Any, vocab_size: int,
                prepare: Callable[[list[Any]], None] | None = None, trainable: bool = True,
                kernels: Mapping[str, str] | None = None, groups: Any = None) -> list[Any]:
    """This rank's model chunks, each a DDP-wrapped (and for bf16 ``Float16Module``-cast) ``GPTModel``.

    Args:
        config: the recipe.
        transformer: the ``TransformerConfig`` from :func:`transformer_config`.
        vocab_size: the padded vocabulary (:func:`padded_vocab_size`).
        prepare: called with this rank's bare ``GPTModel`` chunks before they are wrapped
            (base weights are loaded and LoRA adds its factors and freezes the base here:
            megatron's DDP keeps gradient buffers only for the parameters that require a
            gradient when it wraps, and QLoRA quantises the loaded weights).
        trainable: ``False`` builds a frozen model for forward passes only (DPO's reference):
            no DDP, no gradient hooks, and ``transformer`` is left untouched.
        kernels: the registry kernels of the layers, ``adapt(features=...)``'s ``report.kernels``
            (``None``: "auto" for every op; see ``get_gpt_layer_spec``).
        groups: the process groups (:func:`default_groups`; ``None``: read them here), given
            to ``GPTModel`` and megatron's DDP and deciding the pipeline stages.

    Returns:
        One chunk per virtual pipeline stage (one without interleaving).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import (
        is_pp_first_stage,
        is_pp_last_stage,
        is_vp_first_stage,
        is_vp_last_stage,
    )
    from megatron.core.transformer.module import Float16Module

    from mindspeed.megatron.spec import check_config_for_spec, get_gpt_layer_spec
    from mindspeed.patching import PatchSet
    from mindspeed_llm.bridges.megatron_model import block_spec, layer_specs, mla_without_te_patch

    m, p = config.model, config.parallel
    check_config_for_spec(transformer, swiglu=m.swiglu)
    # Hugging Face weights come in and go out through the bridges, which name experts as
    # megatron's SequentialMLP does; otherwise the moe_grouped_gemm feature decides.
    bridged = bool(config.checkpoint.load_hf or config.checkpoint.save_hf)
    spec = get_gpt_layer_spec(kernels, num_experts=m.num_moe_experts, qk_layernorm=m.qk_layernorm,
                              normalization=m.normalization, swiglu=m.swiglu,
                              moe_grouped_gemm=False if bridged else None)
    per_layer = layer_specs(transformer, kernels) if _needs_layer_specs(transformer) else None
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.train.precision != "fp32", overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather, use_distributed_optimizer=p.distributed_optimizer,
    )
    groups = groups if groups is not None else default_groups()
    device = get_accelerator().device()
    models = []
    patches = PatchSet([mla_without_te_patch()] if transformer.multi_latent_attention else [])
    patches.apply(get_accelerator())
    for stage in range(p.vpp or 1):
        vp_stage = stage if p.vpp else None
        layers = spec if per_layer is None else block_spec(transformer, per_layer, vp_stage)
        gpt = GPTModel(
            config=transformer, transformer_layer_spec=layers, vocab_size=vocab_size,
            max_sequence_length=m.max_position_embeddings or config.data.seq_length,
            pre_process=is_pp_first_stage(groups.pp) and is_vp_first_stage(vp_stage, p.vpp),
            post_process=is_pp_last_stage(groups.pp) and is_vp_last_stage(vp_stage, p.vpp),
            share_embeddings_and_output_weights=m.tie_embeddings, position_embedding_type=m.position_embedding_type,
            rotary_base=m.rotary_base, rope_scaling=m.rope_scaling, rope_scaling_factor=m.rope_scaling_factor,
            vp_stage=vp_stage, pg_collection=groups,
        )
        models.append(gpt.to(device))
    patches.revert()  # megatron reads the patched flag only while it builds
    if prepare is not None:
        prepare(models)
    chunks = []
    for stage, gpt in enumerate(models):
        module = Float16Module(transformer, gpt) if transformer.bf16 else gpt
        if not trainable:
            module.requires_grad_(False)
            chunks.append(module)
            continue
        # Megatron buckets only the first chunk's gradients; the others use one bucket each.
        chunks.append(DistributedDataParallel(transformer, ddp_config, module, disable_bucketing=stage > 0,
                                              pg_collection=groups))
    if not trainable:
        return chunks
    transformer.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in chunks]
    transformer.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    if p.overlap_param_gather:
        params = [chunk.start_param_sync for chunk in chunks]
        transformer.param_sync_func = params if len(params) > 1 else params[0]
    if p.overlap_grad_reduce:
        grads = [chunk.start_grad_sync for chunk in chunks]
        transformer.grad_sync_func = grads if len(grads) > 1 else grads[0]
    return chunks


def _needs_layer_specs(transformer: Any) -> bool:
    # MLA, or dense layers between MoE layers: one spec per layer (DeepSeek-V3).
    return bool(transformer.multi_latent_attention or isinstance(transformer.moe_layer_freq, list))


def unwrap(chunk: Any) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP and ``Float16Module`` wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def count_parameters(chunks: list[Any], groups: Any = None) -> int:
    """Parameters of the whole model (summed over tensor and pipeline ranks; collective).

    The tied output layer of the last stage is counted once, experts on every expert rank.
    ``groups``: the process groups (:func:`default_groups`; ``None``: read them here).
    """
    import torch.distributed as dist

    groups = groups if groups is not None else default_groups()
    local = 0
    for chunk in chunks:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights and not gpt.pre_process:
                continue
            is_expert = not getattr(param, "allreduce", True)
            local += param.numel() * (groups.ep.size() if is_expert else 1)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total, group=groups.mp)
    return int(total.item())
