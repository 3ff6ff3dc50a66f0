"""Direct preference optimisation: the losses, sequence log-probabilities and the reference pass.

A microbatch holds preference pairs as one packed sequence (see
:func:`~mindspeed_llm.training.finetune_data.pairwise_microbatch`): the chosen answer of pair
``k`` is sequence ``2k``, the rejected one ``2k + 1``. The log-probability of an answer is the
sum of its trained tokens' log-probabilities, i.e. minus the sum of megatron's per-token
cross-entropy over them. With ``pi`` the policy's and ``ref`` the frozen reference's
log-probabilities, ``z = beta * ((pi_c - pi_r) - (ref_c - ref_r))`` and the losses are
(TRL's definitions, Rafailov et al. 2023; hinge from SLiC; IPO from Azar et al. 2023):

- ``sigmoid``: ``-log sigmoid(z) (1 - eps) - log sigmoid(-z) eps`` (``eps`` = label smoothing);
- ``hinge``: ``relu(1 - z)``;
- ``ipo``: ``(z / beta - 1 / (2 beta))^2``.

The implicit rewards are ``beta (pi - ref)`` of each answer; accuracy is the fraction of
pairs whose chosen reward is higher. The reference log-probabilities come from a forward-only
pass of the reference model over the same microbatches before each step (:func:`reference_logps`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mindspeed_llm.training.steps import packed_seq_params

#: The metrics a DPO step reports (TRL's names), each averaged over the pairs.
DPO_LOSS = "dpo loss"
DPO_METRICS = (
    DPO_LOSS,
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

LossType = Literal["sigmoid", "hinge", "ipo"]


@dataclass(frozen=True)
class DpoLossOutput:
    """Per-pair losses and implicit rewards."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: LossType = "sigmoid",
) -> DpoLossOutput:
    """The DPO loss of each pair from the four sequence log-probabilities (each ``[pairs]``).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type={loss_type!r} is not one of sigmoid, hinge, ipo")
    return DpoLossOutput(
        losses,
        beta * (policy_chosen - reference_chosen).detach(),
        beta * (policy_rejected - reference_rejected).detach(),
    )


def sequence_logps(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Sum of the trained tokens' log-probabilities of each packed sequence (``[num_sequences]``).

    Args:
        per_token_loss: megatron's per-token cross-entropy (``-log p`` of each target).
        loss_mask: 1 on trained tokens.
        sequence_index: the sequence of each token (-1 on padding).
        num_sequences: sequences in the microbatch.
    """
    logp = -(per_token_loss.float().reshape(-1) * loss_mask.reshape(-1).float())
    index = sequence_index.reshape(-1).clamp_min(0)  # padding has a zero mask: it adds nothing
    return torch.zeros(num_sequences, dtype=logp.dtype, device=logp.device).index_add(0, index, logp)


def _num_pairs(batch: dict[str, Any]) -> int:
    return int(batch["sequence_index"].max().item()) // 2 + 1


def _dpo_loss_func(
    beta: float, label_smoothing: float, loss_type: LossType, batch: dict[str, Any], output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    pairs = _num_pairs(batch)
    logps = sequence_logps(output, batch["loss_mask"], batch["sequence_index"], 2 * pairs)
    ref = batch["ref_logps"].to(logps)
    out = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta, label_smoothing, loss_type)
    loss = out.losses.sum()
    n = torch.tensor(float(pairs))
    values = {
        DPO_LOSS: loss.detach(),
        "rewards/chosen": out.chosen_rewards.sum(),
        "rewards/rejected": out.rejected_rewards.sum(),
        "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float().sum(),
        "rewards/margins": (out.chosen_rewards - out.rejected_rewards).sum(),
        "logps/chosen": logps[0::2].detach().sum(),
        "logps/rejected": logps[1::2].detach().sum(),
    }
    return loss, n.to(torch.int), {k: torch.stack([v.detach().float().cpu(), n]) for k, v in values.items()}


def dpo_loss_func(beta: float, label_smoothing: float = 0.0, loss_type: LossType = "sigmoid") -> Any:
    """The DPO :data:`~mindspeed_llm.training.steps.LossFunc` (needs ``batch["ref_logps"]``)."""
    func = partial(_dpo_loss_func, beta, label_smoothing, loss_type)
    func.metrics = DPO_METRICS  # type: ignore[attr-defined]
    return func


def _collect_logps(
    batch: dict[str, Any], output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logps = sequence_logps(output, batch["loss_mask"], batch["sequence_index"], 2 * _num_pairs(batch))
    return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {"logps": logps.detach()}


def _forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed_seq_params(batch)
    )
    return output, partial(_collect_logps, batch)


def reference_logps(
    chunks: list[Any], batches: list[dict[str, Any]], groups: Any = None, dualpipev: bool = False
) -> None:
    """Run the reference model over ``batches`` and store ``batch["ref_logps"]`` (collective).

    The log-probabilities exist on the stage where the loss is computed (the last pipeline stage;
    rank 0 under DualPipeV, ``dualpipev``: the chunks are the V, its forward-only schedule runs
    them over the process groups ``groups``); the other stages leave the batches as they are.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mindspeed.megatron.dualpipev import forward_backward_dualpipev

    for chunk in chunks:
        chunk.eval()
    micro_batch_size, seq_length = batches[0]["tokens"].shape
    schedule = partial(forward_backward_dualpipev, pg_collection=groups) if dualpipev else get_forward_backward_func()
    with torch.no_grad():
        outputs = schedule(
            forward_step_func=_forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    for batch, item in zip(batches, outputs or []):
        batch["ref_logps"] = item["logps"]
