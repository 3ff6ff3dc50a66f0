"""Measure a :class:`~mindspeed.autosettings.Layout` of a small GPT on the current gloo ranks.

What the auto-settings models are checked against: the tiny megatron-core GPT of
:mod:`mindspeed.testing.megatron` built with the job's shape on the layout (registry spec,
"auto" kernels as the LLM trainer uses them), the memory features installed through their
own hooks, megatron's optimizer (Adam; the distributed one where the layout says), trained
for a few steps. Per rank: the peak of the device pool from before the model is built (the
dispatch tracker on the CPU, the allocator on a device) and the process CPU time of each
timed step. The caller has adapted megatron-core and initialised torch.distributed.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed.autosettings.layout import Layout
from mindspeed.autosettings.spec import JobSpec


@dataclass
class Measured:
    """One rank's measurements of a layout.

    Attributes:
        peak_bytes: the device pool's peak over model build, optimizer build and the steps.
        cpu_s: process CPU seconds of each timed step.
        wall_s: wall seconds of each timed step.
        losses: the whole batch's loss per step.
    """

    peak_bytes: int = 0
    cpu_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def feature_settings(layout: Layout) -> dict[str, Any]:
    """The ``FeaturesConfig.settings`` of the layout's memory features."""
    return layout.overrides(1, 1)["features"]["settings"]


def transformer_overrides(job: JobSpec, layout: Layout) -> dict[str, Any]:
    """Extra ``TransformerConfig`` fields of the layout (precision and megatron's recompute)."""
    dtype = torch.bfloat16 if job.precision == "bf16" else torch.float32
    fields: dict[str, Any] = dict(
        use_te_activation_func=True, bf16=job.precision == "bf16", params_dtype=dtype, pipeline_dtype=dtype
    )
    if layout.recompute == "selective":
        fields["recompute_granularity"] = "selective"
    elif layout.recompute == "full":
        layers = job.shape.num_layers // (layout.pp * layout.chunks)
        method = "uniform" if layout.recompute_layers >= layers else "block"
        fields.update(
            recompute_granularity="full",
            recompute_method=method,
            recompute_num_layers=1 if method == "uniform" else layout.recompute_layers,
        )
    return fields


def measure_layout(job: JobSpec, layout: Layout, steps: int = 2, timed_steps: int = 0, seed: int = 1234) -> Measured:
    """Build, train ``steps`` steps under the memory tracker, then time ``timed_steps`` more without it.

    Args:
        job: the model and batch (``global_batch_size`` sequences per step).
        layout: the layout; its world size must be the group's. Context parallelism is not
            measured here (the tiny GPT's batches are not split along the sequence).
        steps: steps counted for the peak (the first one creates the optimizer state).
        timed_steps: steps timed afterwards (CPU and wall time per step).
        seed: weights and data.

    Raises:
        ValueError: the layout does not match the world size, or uses cp > 1.
    """
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mindspeed.device import get_accelerator
    from mindspeed.features import BuildContext, FeaturesConfig, apply_features
    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.metrics.memory import StorageTracker, resolve_method
    from mindspeed.testing.megatron import (
        ParallelSizes,
        TinyGPTConfig,
        build_gpt,
        destroy_parallel,
        init_parallel,
        local_batches,
        make_batches,
        train_step,
    )

    if layout.world_size != dist.get_world_size():
        raise ValueError(
            f"layout {layout.label()} needs {layout.world_size} ranks, the group has {dist.get_world_size()}"
        )
    if layout.cp > 1:
        raise ValueError("measure_layout does not split sequences: use cp=1")
    shape = job.shape
    model = TinyGPTConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        vocab_size=job.padded_vocab(layout.tp),
        seq_length=job.seq_length,
        untie_embeddings_and_output_weights=not shape.tie_embeddings,
        seed=seed,
    )
    sizes = ParallelSizes(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, sequence_parallel=layout.sequence_parallel)
    context = BuildContext()
    apply_features(FeaturesConfig(optimization_level=0, settings=feature_settings(layout)), context)
    bf16 = job.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    accelerator = get_accelerator()
    on_host = resolve_method() == "dispatch"
    result = Measured()
    init_parallel(sizes, seed)
    try:
        gc.collect()
        tracker = StorageTracker(from_empty=True) if on_host else None
        if tracker is not None:
            tracker.__enter__()
        else:
            accelerator.synchronize()
            accelerator.reset_peak_memory_stats()
            base = accelerator.memory_stats()["allocated"]
        try:
            chunks = build_gpt(
                model,
                sizes,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=bf16, use_distributed_optimizer=layout.distributed_optimizer
                ),
                layer_spec=get_gpt_layer_spec({}),
                **transformer_overrides(job, layout),
            )
            for hook in context.hooks["post_model_build"]:
                hook(chunks)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=1e-3,
                    bf16=bf16,
                    params_dtype=dtype,
                    clip_grad=1.0,
                    use_distributed_optimizer=layout.distributed_optimizer,
                ),
                chunks,
            )
            for hook in context.hooks["post_optimizer_build"]:
                optimizer = hook(optimizer) or optimizer
            micro = layout.num_microbatches(job.global_batch_size)
            batches = local_batches(make_batches(model, micro, layout.micro_batch_size * layout.dp, seed=seed))
            for _ in range(steps):
                result.losses.append(train_step(chunks, optimizer, batches)[0])
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
                result.peak_bytes = tracker.peak_bytes
            else:
                accelerator.synchronize()
                result.peak_bytes = accelerator.memory_stats()["peak_allocated"] - base
        for _ in range(timed_steps):
            dist.barrier()
            accelerator.synchronize()
            cpu, wall = time.process_time(), time.perf_counter()
            result.losses.append(train_step(chunks, optimizer, batches)[0])
            accelerator.synchronize()
            result.cpu_s.append(time.process_time() - cpu)
            result.wall_s.append(time.perf_counter() - wall)
        del chunks, optimizer
        gc.collect()
    finally:
        destroy_parallel()
    return result
