"""Reward-model training: a scalar score head on the GPT and the Bradley-Terry loss of TRL's ``RewardTrainer``.

The model is megatron-core's ``GPTModel`` whose output layer is replaced by a
:class:`ScoreHead` (``hidden -> 1``, no bias: transformers' ``*ForSequenceClassification``
``score`` layer with ``num_labels=1``). ``GPTModel`` calls its output layer on the final
norm's hidden states and, without labels, returns what it gives: ``[batch, tokens, 1]``.

A microbatch holds preference pairs packed as DPO's (see
:func:`~mindspeed_llm.training.finetune_data.pairwise_microbatch`): the chosen answer of pair
``k`` is sequence ``2k``, the rejected one ``2k + 1``. The reward of a sequence is the head's
value at its last token (transformers' sequence classification takes the last non-pad token).
With ``d = r_chosen - r_rejected`` the loss of a pair is ``-log sigmoid(d - margin)``, plus
``coef * (r_chosen + r_rejected)^2`` with TRL's ``center_rewards_coefficient`` (its
``mean((r_c + r_r)^2)`` over the batch, as every pair weighs the same in the step mean).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mindspeed.config import ConfigError

#: The metric reported as the step's ``loss``.
RM_LOSS = "rm loss"
#: The metrics a reward-model step reports, each averaged over the pairs.
RM_METRICS = (RM_LOSS, "accuracy", "margin", "rewards/chosen", "rewards/rejected")


class ScoreHead(torch.nn.Module):
    """The scalar score head in the place of ``GPTModel.output_layer`` (called as megatron calls its output layer).

    Its weight is replicated over tensor-parallel ranks: they hold the same hidden states
    (without sequence parallelism), so their gradients agree, and megatron counts a
    non-tensor-parallel parameter once in the gradient norm.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight), None


def attach_score_head(models: list[Any], std: float, seed: int) -> None:
    """Replace the output layer of the last pipeline stage's chunk by a :class:`ScoreHead`.

    The head is drawn from ``N(0, std)`` with a generator seeded by ``seed`` (the same on every
    rank; transformers initialises ``score`` with ``N(0, initializer_range)``).

    Raises:
        ConfigError: the model ties its output layer to the embedding over pipeline stages
            (megatron would synchronise the head with the embedding).
    """
    for gpt in models:
        if not getattr(gpt, "post_process", False):
            continue
        if gpt.share_embeddings_and_output_weights and not gpt.pre_process:
            raise ConfigError(
                "rm: the model ties its output layer to the embedding and parallel.pp > 1 would keep them in "
                "sync; train the reward model with parallel.pp=1"
            )
        old = gpt.output_layer
        reference = next(old.parameters(), None) if old is not None else None
        reference = reference if reference is not None else gpt.embedding.word_embeddings.weight
        head = ScoreHead(gpt.config.hidden_size, reference.dtype, reference.device)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        gpt.output_layer = head
        # The logits are the score: the tied-embedding path must not feed the embedding in.
        gpt.share_embeddings_and_output_weights = False


def sequence_rewards(scores: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Each packed sequence's score at its last token (``[num_sequences]``).

    Args:
        scores: the head's output over the microbatch's tokens (any shape holding ``T`` values).
        sequence_index: the sequence of each token (-1 on padding).
        num_sequences: sequences in the microbatch.
    """
    values = scores.reshape(-1).float()
    index = sequence_index.reshape(-1)
    positions = torch.arange(index.numel(), device=index.device)
    last = torch.full((num_sequences,), -1, dtype=torch.long, device=index.device)
    keep = index >= 0
    last = last.scatter_reduce(0, index[keep], positions[keep], reduce="amax")
    return values[last]


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0, center_coefficient: float | None = None
) -> torch.Tensor:
    """Per-pair loss ``-log sigmoid(r_c - r_r - margin)`` (+ ``coef (r_c + r_r)^2``)."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def rm_loss_func(margin: float = 0.0, center_coefficient: float | None = None) -> Any:
    """The reward-model :data:`~mindspeed_llm.training.steps.LossFunc` (the model runs without labels)."""

    def loss_func(
        batch: dict[str, Any], output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        pairs = int(batch["sequence_index"].max().item()) // 2 + 1
        rewards = sequence_rewards(output, batch["sequence_index"], 2 * pairs)
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = bradley_terry_loss(chosen, rejected, margin, center_coefficient).sum()
        n = torch.tensor(float(pairs))
        values = {
            RM_LOSS: loss.detach(),
            "accuracy": (chosen > rejected).float().sum(),
            "margin": (chosen - rejected).detach().sum(),
            "rewards/chosen": chosen.detach().sum(),
            "rewards/rejected": rejected.detach().sum(),
        }
        return loss, n.to(torch.int), {k: torch.stack([v.detach().float().cpu(), n]) for k, v in values.items()}

    loss_func.metrics = RM_METRICS  # type: ignore[attr-defined]
    loss_func.needs_logits = True  # type: ignore[attr-defined]
    return loss_func
