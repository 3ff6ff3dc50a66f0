"""One training step and one evaluation pass through megatron-core's pipeline schedules.

``get_forward_backward_func()`` picks the schedule of the layout (no pipelining, 1F1B, or
interleaved 1F1B with virtual stages) and accumulates gradients over the microbatches. The
loss of a microbatch is megatron's: the masked sum of per-token losses with its token count;
the schedule divides by both, so the gradients are those of the per-token mean. The reported
loss is the token-weighted mean over the whole global batch, reduced from the last pipeline
stage and over data-parallel ranks, so every rank sees the same number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

#: ``(step, per-token losses) -> per-token losses``: a seam for tests (inject a NaN) and experiments.
LossTransform = Callable[[int, torch.Tensor], torch.Tensor]


def _loss_func(loss_mask: torch.Tensor, transform: Callable[[torch.Tensor], torch.Tensor] | None,
               output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    losses = output.float().reshape(-1)
    if transform is not None:
        losses = transform(losses)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum()
    return loss, tokens.to(torch.int), {"lm loss": torch.stack([loss.detach().clone(), tokens.detach()])}


def _forward_step(transform: Callable[[torch.Tensor], torch.Tensor] | None, data_iterator: Iterator[dict[str, Any]],
                  model: Any) -> tuple[torch.Tensor, Callable]:
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"], transform)


def reduce_loss(outputs: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
    """The global batch's mean per-token loss and its token count, on every rank (collective).

    Args:
        outputs: what the schedule returned (the microbatches' ``[loss sum, tokens]`` on the
            last pipeline stage, nothing elsewhere).
    """
    from megatron.core import parallel_state as ps

    total = torch.zeros(2, dtype=torch.float64)
    for item in outputs:
        total += item["lm loss"].to(torch.float64).cpu()
    # The last stage holds the sums; the others add zeros. gloo has no AVG: sum, then divide.
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    loss_sum, tokens = total.tolist()
    return (loss_sum / tokens if tokens else float("nan")), int(tokens)


def forward_backward(chunks: list[Any], batches: list[dict[str, torch.Tensor]], forward_only: bool = False,
                     transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[float, int]:
    """One pass of megatron's schedule over this rank's microbatches of a step.

    Args:
        chunks: this rank's model chunks.
        batches: the microbatches (every pipeline stage and virtual stage reads the same list).
        forward_only: evaluation (no backward, no gradient reduction).
        transform: applied to the per-token losses before masking.

    Returns:
        :func:`reduce_loss` of the pass.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch_size, seq_length = batches[0]["tokens"].shape
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, transform), data_iterator=[iter(batches) for _ in chunks],
        model=chunks, num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return reduce_loss(outputs or [])


def evaluate(chunks: list[Any], steps: list[list[dict[str, torch.Tensor]]]) -> tuple[float, int]:
    """Mean per-token loss over several global batches of validation data (collective).

    Args:
        chunks: this rank's model chunks (put back in training mode afterwards).
        steps: per global batch, this rank's microbatches.
    """
    for chunk in chunks:
        chunk.eval()
    loss_sum, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for batches in steps:
                loss, count = forward_backward(chunks, batches, forward_only=True)
                loss_sum += loss * count
                tokens += count
    finally:
        for chunk in chunks:
            chunk.train()
    return (loss_sum / tokens if tokens else float("nan")), tokens
