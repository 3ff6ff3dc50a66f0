"""Context parallelism in the LLM trainer: the data split and the loss over the CP group.

Inside megatron-core every algorithm (``ulysses_cp_algo``, ``megatron_cp_algo``,
``hybrid_cp_algo``) takes megatron's zig-zag layout: megatron's rope cuts its frequencies
that way and ``RegistryAttention`` reorders for Ulysses and hybrid
(``mindspeed.megatron.modules``). So the data side is the same for all of them:

- a plain microbatch ``[b, s]`` keeps chunks ``r`` and ``2C - 1 - r`` of ``2C`` of every
  per-token tensor on CP rank ``r`` (``split_for_context_parallel`` with ``megatron_cp_algo``);
- a packed (THD) microbatch keeps those chunks of every packed sequence, sequence after
  sequence (megatron's THD layout; ``cu_seqlens`` stays global and every sequence length is a
  multiple of ``2C``, which the packing pads to).

The loss: a pretraining step averages per microbatch (megatron divides a microbatch's loss sum
by its token count), but under CP each rank sees only its shard's tokens, whose counts differ
when the loss mask does. :func:`context_parallel_loss` rescales each rank's sum by the
microbatch's count over the CP group, so that DDP's average over data x context ranks gives the
gradient of the whole sequence's mean, as at CP1. Fine-tuning divides by the step's total token
count, which megatron already sums over data x context ranks: nothing to change there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.features import ModelFacts
from mindspeed.model.shape import ModelShape
from mindspeed.ops.attention import FEATURE_ALIBI, FEATURE_ALIBI_OFFSET, FEATURE_LSE, FEATURE_VARLEN
from mindspeed.parallel.context_parallel import ADAPTIVE, HYBRID, RING, split_for_context_parallel
from mindspeed.parallel.context_parallel.layout import split_packed_for_context_parallel
from mindspeed_llm.training.config import PretrainConfig
from mindspeed_llm.training.steps import LM_LOSS, LossFunc

#: Per-token tensors of a microbatch that are split along the sequence (``[b, s]``, or ``[s]``).
SPLIT_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "sequence_index")


def context_parallel_algo(config: PretrainConfig) -> str:
    """The recipe's ``features.settings.context_parallel.context_parallel_algo`` (default: the ring)."""
    settings = config.features.settings.get("context_parallel") or {}
    if not isinstance(settings, dict):
        settings = dataclasses.asdict(settings)
    return settings.get("context_parallel_algo") or RING


def context_parallel_facts(facts: ModelFacts, config: PretrainConfig, shape: ModelShape) -> ModelFacts:
    """``facts`` with what CP needs of the attention kernel and the heads the feature checks.

    Ring, hybrid and adaptive (which may run the ring) merge blocks by their log-sum-exp (``lse``); packed stages (sft) attend
    within ``cu_seqlens`` (``varlen``); an ALiBi model under the ring biases each block by its global positions
    (``alibi_offset``). The attention-kernel feature picks a kernel that has them all.
    """
    needs = set(facts.attention_features)
    if context_parallel_algo(config) in (RING, HYBRID, ADAPTIVE):
        needs.add(FEATURE_LSE)
    if FEATURE_ALIBI in needs and context_parallel_algo(config) in (RING, ADAPTIVE):
        needs.add(FEATURE_ALIBI_OFFSET)
    if config.stage != "pretrain":
        needs.add(FEATURE_VARLEN)
    extra = {
        **facts.extra,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_query_groups or shape.num_attention_heads,
    }
    return dataclasses.replace(facts, attention_features=tuple(sorted(needs)), extra=extra)


def split_microbatch(batch: dict[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """CP rank ``cp_rank``'s part of a microbatch (the other entries, ``cu_seqlens`` included, unchanged)."""
    if cp_size == 1:
        return batch
    bounds = batch["cu_seqlens"].tolist() if "cu_seqlens" in batch else None
    out = dict(batch)
    for key in SPLIT_KEYS:
        if key not in batch:
            continue
        value = batch[key]
        dim = value.dim() - 1
        if bounds is not None:
            out[key] = split_packed_for_context_parallel(value, dim, bounds, cp_rank, cp_size)
        else:
            out[key] = split_for_context_parallel(value, dim, cp_rank, cp_size, RING)
    return out


class ContextParallelReader:
    """A stage's microbatch reader whose microbatches are split for this CP rank.

    Args:
        reader: the stage's reader (``step(consumed, num_microbatches)``).
        cp_rank: this rank in the CP group.
        cp_size: the CP degree.
    """

    def __init__(self, reader: Any, cp_rank: int, cp_size: int) -> None:
        self.reader, self.cp_rank, self.cp_size = reader, cp_rank, cp_size

    def step(self, consumed: int, num_microbatches: int) -> list[dict[str, Any]]:
        """This CP rank's shards of the step's microbatches."""
        return [split_microbatch(b, self.cp_rank, self.cp_size) for b in self.reader.step(consumed, num_microbatches)]


def context_parallel_loss(loss_fn: LossFunc, cp_group: Any) -> LossFunc:
    """``loss_fn`` for a schedule that divides each microbatch by its own token count, under CP.

    Returns ``(sum * C * local count / CP count, local count, metrics)``: megatron divides by
    the local count, DDP by ``C`` (and the data-parallel size), so the gradient is the CP
    group's sum over the microbatch's count over the group: the whole sequence's mean. The
    metrics keep the local sums and counts (:func:`~mindspeed_llm.training.steps.reduce_metrics`
    adds them over the CP ranks).
    """
    size = cp_group.size()

    def loss_func(batch: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss, count, metrics = loss_fn(batch, output)
        total = count.detach().to(torch.float64).clone()
        dist.all_reduce(total, group=cp_group)
        scale = size * count.to(torch.float64) / total.clamp_min(1)
        return loss * scale.to(loss.dtype), count, metrics

    loss_func.metrics = getattr(loss_fn, "metrics", (LM_LOSS,))
    return loss_func
