"""One training step and one evaluation pass through megatron-core's pipeline schedules.

``get_forward_backward_func()`` picks the schedule of the layout (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages) and accumulates gradients over the microbatches. The
loss of a microbatch is megatron's: the masked sum of per-token losses with its token count;
the schedule divides by both, so the gradients are those of the per-token mean. The reported
loss is the token-weighted mean over the whole global batch, reduced from the last pipeline
stage and over data-parallel ranks, so every rank sees the same number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.megatron.dualpipev import forward_backward_dualpipev
from mindspeed_llm.training.model import default_groups

#: ``(step, per-token losses) -> per-token losses``: a seam for tests (inject a NaN) and experiments.
LossTransform = Callable[[int, torch.Tensor], torch.Tensor]


#: ``(batch, per-token losses) -> (loss sum, count, {metric: [sum, count]})``: what a stage
#: trains on (megatron divides the sum by the count, or, with ``calculate_per_token_loss``,
#: the gradients by the count summed over the whole step). Its ``metrics`` attribute names
#: the metrics it reports; a true ``needs_logits`` attribute runs the model without labels (the
#: loss gets its outputs: a reward model's scores).
LossFunc = Callable[[dict[str, Any], torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]

#: The metric key of the language-model loss.
LM_LOSS = "lm loss"


def lm_loss(transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LossFunc:
    """The masked per-token cross-entropy (pretraining and SFT), ``transform`` applied first."""

    def loss_func(
        batch: dict[str, Any], output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        losses = output.float().reshape(-1)
        if transform is not None:
            losses = transform(losses)
        mask = batch["loss_mask"].reshape(-1).float()
        loss = torch.sum(losses * mask)
        tokens = mask.sum()
        return loss, tokens.to(torch.int), {LM_LOSS: torch.stack([loss.detach().clone(), tokens.detach()])}

    loss_func.metrics = (LM_LOSS,)
    return loss_func


def packed_seq_params(batch: dict[str, Any]) -> Any:
    """Megatron's ``PackedSeqParams`` (THD) of a microbatch with ``cu_seqlens``, else ``None``."""
    if "cu_seqlens" not in batch:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )


def _forward_step(
    loss_fn: LossFunc, data_iterator: Iterator[dict[str, Any]], model: Any
) -> tuple[torch.Tensor, Callable]:
    batch = next(data_iterator)
    # A loss on the model's outputs (a reward model's scores) runs it without labels.
    labels = None if getattr(loss_fn, "needs_logits", False) else batch["labels"]
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=labels, packed_seq_params=packed_seq_params(batch)
    )
    return output, partial(loss_fn, batch)


def reduce_metrics(
    outputs: list[dict[str, torch.Tensor]], names: tuple[str, ...] = (LM_LOSS,), groups: Any = None
) -> dict[str, tuple[float, int]]:
    """Every metric's mean over the global batch and its count, on every rank (collective).

    Args:
        outputs: what the schedule returned (per microbatch ``{metric: [sum, count]}`` on the
            last pipeline stage, nothing elsewhere).
        names: the metrics (known on every stage, so that all join the same reductions).
        groups: the process groups (``model.default_groups()``; ``None``: read them here).
    """
    groups = groups if groups is not None else default_groups()
    total = torch.zeros(len(names), 2, dtype=torch.float64)
    for item in outputs:
        for row, name in enumerate(names):
            total[row] += item[name].to(torch.float64).cpu()
    # The last stage holds the sums; the others add zeros. gloo has no AVG: sum, then divide.
    # Context-parallel ranks hold shards of the same sequences: their sums and counts add up too.
    # A one-rank group's sum is the tensor itself: skip its collective (~90 us of gloo thread hand-off each).
    for group in (groups.pp, groups.dp_cp):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return {name: ((s / n) if n else float("nan"), int(n)) for name, (s, n) in zip(names, total.tolist())}


def run_schedule(
    chunks: list[Any],
    batches: list[dict[str, Any]],
    loss_fn: LossFunc,
    forward_only: bool = False,
    groups: Any = None,
    schedule_hooks: Sequence[Callable[..., Any]] = (),
    dualpipev: bool = False,
) -> dict[str, tuple[float, int]]:
    """One pass of megatron's schedule over this rank's microbatches of a step.

    Args:
        chunks: this rank's model chunks.
        batches: the microbatches (every pipeline stage and virtual stage reads the same list).
        loss_fn: the stage's loss.
        forward_only: evaluation (no backward, no gradient reduction).
        groups: the process groups (``model.default_groups()``; ``None``: read them here): the
            schedule, its pipeline messages and the gradient finalisation use them.
        schedule_hooks: the features' ``pipeline_schedule`` hooks: ``hook(chunks, num_microbatches)``
            returns ``None`` or a wrapper of this pass (``wrap_forward_step``, ``communicator``,
            ``finishing``: recompute-in-bubble), at most one.
        dualpipev: run DualPipeV's schedule (``mindspeed.megatron.dualpipev``) over the V's two chunks.

    Returns:
        :func:`reduce_metrics` of the pass.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    groups = groups if groups is not None else default_groups()
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    metric_names = getattr(loss_fn, "metrics", (LM_LOSS,))
    if dualpipev:
        outputs = forward_backward_dualpipev(
            forward_step_func=partial(_forward_step, loss_fn),
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            pg_collection=groups,
        )
        return reduce_metrics(outputs, metric_names, groups)
    schedule = get_forward_backward_func(pp_size=groups.pp.size(), vp_size=len(chunks) if len(chunks) > 1 else None)
    forward_step_func = partial(_forward_step, loss_fn)
    config = get_model_config(chunks[0])
    wrappers = [w for hook in ([] if forward_only else schedule_hooks) if (w := hook(chunks, len(batches)))]
    if len(wrappers) > 1:
        raise ValueError(f"{len(wrappers)} features wrap the pipeline schedule; enable at most one of them")
    wrapper = wrappers[0] if wrappers else None
    if wrapper is not None:
        forward_step_func = wrapper.wrap_forward_step(forward_step_func)
        communicator = wrapper.communicator(groups.pp, config)
    else:
        communicator = P2PCommunicator(pp_group=groups.pp, config=config)
    with wrapper.finishing() if wrapper is not None else contextlib.nullcontext():
        outputs = schedule(
            forward_step_func=forward_step_func,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            pg_collection=groups,
            p2p_communicator=communicator,
        )
    return reduce_metrics(outputs or [], metric_names, groups)


def forward_backward(
    chunks: list[Any],
    batches: list[dict[str, Any]],
    forward_only: bool = False,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    groups: Any = None,
    schedule_hooks: Sequence[Callable[..., Any]] = (),
) -> tuple[float, int]:
    """The language-model loss pass of :func:`run_schedule`: ``(mean per-token loss, tokens)``."""
    return run_schedule(chunks, batches, lm_loss(transform), forward_only, groups, schedule_hooks)[LM_LOSS]


def evaluate(
    chunks: list[Any],
    steps: list[list[dict[str, Any]]],
    loss_fn: LossFunc | None = None,
    key: str = LM_LOSS,
    groups: Any = None,
) -> tuple[float, int]:
    """Mean of the metric ``key`` over several global batches of validation data (collective).

    Args:
        chunks: this rank's model chunks (put back in training mode afterwards).
        steps: per global batch, this rank's microbatches.
        loss_fn: the stage's loss (default: the language-model loss).
        key: the metric to average.
        groups: the process groups (``model.default_groups()``; ``None``: read them here).
    """
    return evaluate_metrics(chunks, steps, loss_fn, groups)[key]


def evaluate_metrics(
    chunks: list[Any],
    steps: list[list[dict[str, Any]]],
    loss_fn: LossFunc | None = None,
    groups: Any = None,
    dualpipev: bool = False,
) -> dict[str, tuple[float, int]]:
    """Every metric of ``loss_fn`` averaged over several global batches of validation data (collective).

    Args:
        chunks: this rank's model chunks (put back in training mode afterwards).
        steps: per global batch, this rank's microbatches.
        loss_fn: the stage's loss (default: the language-model loss).
        groups: the process groups (``model.default_groups()``; ``None``: read them here).
        dualpipev: the chunks are DualPipeV's V (its schedule runs the forwards).

    Returns:
        metric -> ``(mean, count)``, each mean weighted by its per-batch count.
    """
    loss_fn = loss_fn or lm_loss()
    sums: dict[str, list[float]] = {}
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            for batches in steps:
                for name, (value, n) in run_schedule(
                    chunks, batches, loss_fn, forward_only=True, groups=groups, dualpipev=dualpipev
                ).items():
                    total = sums.setdefault(name, [0.0, 0])
                    total[0] += value * n
                    total[1] += n
    finally:
        for chunk in chunks:
            chunk.train()
    return {name: ((s / n) if n else float("nan"), int(n)) for name, (s, n) in sums.items()}
