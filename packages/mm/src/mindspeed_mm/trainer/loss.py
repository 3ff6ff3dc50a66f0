"""MindSpeed-MM's three loss reductions, written so that gradient accumulation and data parallelism do not change them.

With ``T`` the token losses of one microbatch (only predicted tokens), ``A`` the microbatches of
a rank per step and ``W`` the data-parallel ranks (FSDP2 averages gradients over them):

- ``default`` (Hugging Face's): each microbatch's token mean, averaged over the ``A x W``
  microbatches of the step. The microbatch's backward loss is ``mean(T) / A``.
- ``per_token``: the sum over the global batch divided by its predicted tokens ``N``: the
  backward loss is ``sum(T) * W / N`` (``N`` all-reduced before the step; the trap of dividing
  by the microbatch's own count, Hugging Face's gradient-accumulation bug, is avoided).
- ``per_sample``: each sample's token mean, averaged over the global batch's ``S`` samples that
  have predicted tokens: ``sum_i mean(T_i) * W / S``.

Each function returns ``(backward_loss, reported_sum)``: the reported loss of the step is the
all-reduced sum of ``reported_sum`` over microbatches and ranks.

With Ulysses sequence parallelism over ``U`` ranks each rank holds a contiguous shard of the
microbatch's tokens: its token losses are divided by the counts of the whole microbatch (or
sample), so the ``U`` ranks' losses add up to the microbatch's, and ``W`` counts every rank
(FSDP2 averages over all of them); ``default`` then scales by ``U``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed_mm.data.encode import IGNORE_INDEX

LOSS_TYPES = ("default", "per_token", "per_sample")


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[L] cross entropy of each position in fp32 (0 where the target is -100)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )


def reduce_loss(
    losses: torch.Tensor,
    targets: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    loss_type: str,
    accumulation: int,
    world: int,
    global_tokens: int,
    global_samples: int,
    *,
    sp: int = 1,
    microbatch_tokens: int | None = None,
    sample_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(backward_loss, reported_sum)`` of one microbatch (or of this rank's shard of it) under ``loss_type``.

    Args:
        losses: [L] token losses (:func:`token_losses`).
        targets: [L] targets (-100: not predicted).
        sample_index: [L] sample of each token.
        num_samples: samples in the microbatch.
        loss_type: ``default``, ``per_token`` or ``per_sample``.
        accumulation: microbatches per rank per step.
        world: ranks gradients are averaged over (data-parallel x sequence-parallel).
        global_tokens: predicted tokens of the step over all ranks (``per_token``).
        global_samples: samples with predicted tokens over all ranks (``per_sample``).
        sp: sequence-parallel ranks sharing the microbatch (``losses`` is then this rank's shard).
        microbatch_tokens: predicted tokens of the whole microbatch (default: those of ``targets``).
        sample_tokens: [num_samples] predicted tokens of each whole sample (default: counted in ``targets``).
    """
    mask = targets != IGNORE_INDEX
    total = (losses * mask).sum()
    if loss_type == "default":
        count = mask.sum().clamp(min=1) if microbatch_tokens is None else max(microbatch_tokens, 1)
        mean = total / count
        return mean * sp / accumulation, mean.detach() * sp / (accumulation * world)
    if loss_type == "per_token":
        scaled = total / max(global_tokens, 1)
        return scaled * world, scaled.detach()
    if loss_type == "per_sample":
        sums = torch.zeros(num_samples, dtype=losses.dtype, device=losses.device).index_add(
            0, sample_index, losses * mask
        )
        if sample_tokens is None:
            counts = torch.zeros(num_samples, dtype=losses.dtype, device=losses.device).index_add(
                0, sample_index, mask.to(losses.dtype)
            )
        else:
            counts = sample_tokens.to(device=losses.device, dtype=losses.dtype)
        means = (sums / counts.clamp(min=1)).sum() / max(global_samples, 1)
        return means * world, means.detach()
    raise ValueError(f"train.loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
