"""Masked reductions, loss aggregation and log-prob/entropy helpers shared by the RL losses.

Shapes: ``[batch, response_len]`` for per-token quantities (log-probs, advantages, masks),
``[batch, response_len, vocab]`` for logits. A mask holds 1 on response tokens that count and
0 on padding (and on prompt tokens when a caller passes whole sequences).
"""

from __future__ import annotations

import torch

#: Loss aggregation modes, named as verl names them (``actor.loss_agg_mode``).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over ``dim``, or everything).

    Padding is selected away rather than multiplied by 0, so garbage there (inf, NaN from an
    empty softmax row) cannot leak into the sum or its gradient.
    """
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 where nothing is set (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, len]`` to a scalar.

    Modes (verl's names):

    - ``token-mean``: every response token of the batch weighs the same (DAPO):
      ``sum(loss * mask) / sum(mask)``.
    - ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences.
    - ``seq-mean-token-mean``: mean over each sequence's tokens, mean over sequences (the GRPO
      paper, TRL's ``loss_type="grpo"``).
    - ``seq-mean-token-sum-norm``: sum over each sequence's tokens divided by a constant length
      (``norm_length``, default the padded length), mean over sequences (Dr. GRPO).

    The sequence modes average over every row of the batch (as TRL and verl do); a row without
    tokens contributes 0.

    Args:
        loss: per-token loss.
        mask: 1 on tokens that count.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens: ``token-mean`` denominator to use instead of this batch's token count: the
            token count of the whole global batch when it is split into micro-batches, so that
            the micro-batch losses add up to the global batch's loss.
        num_seqs: the same for the sequence modes (the number of sequences of the global batch).
        norm_length: ``seq-mean-token-sum-norm``'s constant (default ``loss.shape[-1]``).

    Returns:
        The scalar loss (differentiable).

    Raises:
        ValueError: on an unknown mode or mismatched shapes.
    """
    if loss.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        denominator = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(loss, mask) / denominator
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
    token_sums = masked_sum(loss, mask, dim=-1)
    lengths = mask.sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = token_sums
    elif mode == "seq-mean-token-mean":
        per_seq = token_sums / lengths.clamp(min=1)
    else:
        per_seq = token_sums / float(norm_length or loss.shape[-1])
    denominator = loss.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / denominator


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``logits`` (``[..., vocab]`` -> ``[...]``).

    Computed as ``logit[label] - logsumexp(logits)`` in float32 at least, so bf16 logits do not
    lose the small differences the policy ratio is made of.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each position (``[..., vocab]`` -> ``[...]``).

    ``H = logsumexp(z) - sum(softmax(z) * z)``, which never takes the log of a zero probability.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
