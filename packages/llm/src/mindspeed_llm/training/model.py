"""The megatron-core GPT of a :class:`~mindspeed.model.ModelShape`, on this rank's part of the layout.

Built the way megatron's own training builds it: ``GPTModel`` chunks (one per virtual pipeline
stage, put together by :func:`mindspeed_llm.bridges.megatron_model.build_gpt_chunks` from the
adaptor's registry spec and the core's one ``TransformerConfig`` builder), cast
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
from mindspeed.megatron.config import ParallelSizes, transformer_config
from mindspeed.model.shape import ModelShape
from mindspeed_llm.bridges.megatron_model import build_gpt_chunks
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.sections import ModelConfig, ParallelConfig


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``lcm(divisible_by, tp)``.

    Megatron pads to a multiple of ``divisible_by * tp``, so the same tokenizer gets a different
    embedding at TP1 and TP2 and checkpoints do not move between them; the least common
    multiple gives every tensor-parallel size that divides ``divisible_by`` the same padding.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def parallel_sizes(parallel: ParallelConfig) -> ParallelSizes:
    """The core's :class:`~mindspeed.megatron.config.ParallelSizes` of the recipe's ``parallel`` section."""
    return ParallelSizes(
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.vpp,
        ep=parallel.ep,
        etp=parallel.etp,
        cp=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
    )


def run_settings(
    model: ModelConfig, shape: ModelShape, per_token_loss: bool = False, variable_seq_lengths: bool = False
) -> dict[str, Any]:
    """``TransformerConfig`` fields of a training run that are not the model's shape.

    Args:
        model: the recipe's ``model`` section (dropout, initialisation, recompute, MoE losses and
            dispatcher; its ``megatron`` entries are applied by :func:`build_transformer_config`).
        shape: the model (whether it has experts).
        per_token_loss: divide gradients by the step's total token count instead of averaging per
            microbatch (fine-tuning batches hold different numbers of trained tokens).
        variable_seq_lengths: microbatches of different lengths through the pipeline.
    """
    fields: dict[str, Any] = dict(
        hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std,
        recompute_granularity=model.recompute_granularity,
    )
    if per_token_loss:
        fields["calculate_per_token_loss"] = True
    if variable_seq_lengths:
        fields["variable_seq_lengths"] = True
    if model.recompute_granularity == "full":
        fields.update(recompute_method=model.recompute_method, recompute_num_layers=model.recompute_num_layers)
    if model.recompute_granularity == "selective" and model.recompute_modules is not None:
        fields["recompute_modules"] = list(model.recompute_modules)
    if shape.num_experts:
        fields.update(
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_token_dispatcher_type=model.moe_token_dispatcher_type,
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff else "none",
        )
    return fields


def default_groups() -> Any:
    """megatron's process groups of the initialised parallel state, as one value.

    The one read of megatron's ``parallel_state`` the builders need: a runner calls it once
    after ``initialize_model_parallel`` and passes the result (a ``ProcessGroupCollection``)
    to :func:`build_model`, the optimizer, the schedule and the metrics.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def build_transformer_config(
    shape: ModelShape,
    parallel: ParallelConfig,
    run: ModelConfig | None = None,
    *,
    per_token_loss: bool = False,
    variable_seq_lengths: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """megatron's ``TransformerConfig`` of ``shape`` on ``parallel`` (the core's one builder).

    Args:
        shape: the model.
        parallel: the layout.
        run: the run settings of a ``model`` section (dropout, initialisation, recompute, MoE
            losses and dispatcher, ``megatron`` entries; default: none of them).
        per_token_loss: divide gradients by the step's total token count (fine-tuning, RL).
        variable_seq_lengths: microbatches of different lengths through the pipeline.
        overrides: fields set by features or the caller; ``run.megatron`` entries win over them.
    """
    run = run or ModelConfig()
    settings = run_settings(run, shape, per_token_loss=per_token_loss, variable_seq_lengths=variable_seq_lengths)
    return transformer_config(shape, parallel_sizes(parallel), **{**settings, **(overrides or {}), **run.megatron})


def recipe_transformer_config(
    config: PretrainConfig, shape: ModelShape, overrides: Mapping[str, Any] | None = None
) -> Any:
    """The ``TransformerConfig`` a recipe trains ``shape`` with (:func:`build_transformer_config` of its sections).

    Args:
        config: the recipe (its ``parallel`` section, the stage and the ``model`` run settings).
        shape: the model (:func:`mindspeed_llm.training.hf.model_shape`).
        overrides: fields set by features (``BuildContext.config_overrides``); the recipe's
            ``model.megatron`` entries win over them.
    """
    # Fine-tuning batches hold different numbers of trained tokens (and DPO pairs): the
    # gradients are divided by the step's total count, not averaged per microbatch.
    fine_tune = config.stage != "pretrain"
    if config.train.deterministic:
        # megatron's switch for its deterministic code paths (and its refusal of the others).
        overrides = {**(overrides or {}), "deterministic_mode": True}
    return build_transformer_config(
        shape,
        config.parallel,
        config.model,
        per_token_loss=fine_tune,
        variable_seq_lengths=fine_tune and config.data.variable_seq_lengths and config.parallel.pp > 1,
        overrides=overrides,
    )


def build_model(
    shape: ModelShape,
    parallel: ParallelConfig,
    transformer: Any,
    vocab_size: int,
    prepare: Callable[[list[Any]], None] | None = None,
    trainable: bool = True,
    bridged: bool = False,
    kernels: Mapping[str, str] | None = None,
    groups: Any = None,
    dualpipev: bool = False,
) -> list[Any]:
    """This rank's model chunks, each a DDP-wrapped (and for bf16 ``Float16Module``-cast) ``GPTModel``.

    Args:
        shape: the model.
        parallel: the layout and its data-parallel options (distributed optimizer, overlaps).
        transformer: the ``TransformerConfig`` (:func:`mindspeed.megatron.config.transformer_config`
            of ``shape``, or :func:`recipe_transformer_config`).
        vocab_size: the padded vocabulary (:func:`padded_vocab_size`).
        prepare: called with this rank's bare ``GPTModel`` chunks before they are wrapped
            (base weights are loaded and LoRA adds its factors and freezes the base here:
            megatron's DDP keeps gradient buffers only for the parameters that require a
            gradient when it wraps, and QLoRA quantises the loaded weights).
        trainable: ``False`` builds a frozen model for forward passes only (DPO's reference):
            no DDP, no gradient hooks, and ``transformer`` is left untouched.
        kernels: the registry kernels of the layers, ``adapt(features=...)``'s ``report.kernels``
            (``None``: "auto" for every op; see ``get_gpt_layer_spec``).
        bridged: Hugging Face weights come in or go out through the bridges, which name experts
            as megatron's SequentialMLP does (otherwise the ``moe_grouped_gemm`` feature decides).
        groups: the process groups (:func:`default_groups`; ``None``: read them here), given
            to ``GPTModel`` and megatron's DDP and deciding the pipeline stages.
        dualpipev: DualPipeV's V layout (two chunks per rank; the ``dualpipev`` feature).

    Returns:
        One chunk per virtual pipeline stage (one without interleaving).
    """
    # Lazy: keeps megatron out of the start-up of mindspeed_llm.cli.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mindspeed.megatron.spec import check_config_for_spec

    p = parallel
    check_config_for_spec(transformer, swiglu=shape.swiglu)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=shape.params_dtype != "float32",
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.distributed_optimizer,
    )
    groups = groups if groups is not None else default_groups()
    device = get_accelerator().device()
    models = build_gpt_chunks(
        shape,
        parallel_sizes(p),
        kernels,
        vocab_size=vocab_size,
        transformer=transformer,
        moe_grouped_gemm=False if bridged else None,
        groups=groups,
        dualpipev=dualpipev,
    )
    models = [gpt.to(device) for gpt in models]
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
        chunks.append(
            DistributedDataParallel(transformer, ddp_config, module, disable_bucketing=stage > 0, pg_collection=groups)
        )
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
