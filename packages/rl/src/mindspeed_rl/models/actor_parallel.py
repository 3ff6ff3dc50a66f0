"""The actor's parallel pieces: vocab-parallel log-probs and entropy, pipeline gathers.

Tensor parallelism cuts the output layer by vocabulary rows, so each rank holds the logits of
``[vocab_start, vocab_start + V / tp)``. Log-probs and entropy need statistics of the whole
vocabulary; per position, with ``m`` the global max logit::

    S = sum_v exp(z_v - m)                  (all-reduced)
    log Z = m + log S
    log p(target) = z_target - log Z        (z_target all-reduced from the rank holding it)
    H = log Z - sum_v p_v z_v = log Z - (sum_v exp(z_v - m) z_v) / S

The sums go through megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce
forward, identity backward): every rank computes the same loss, and the gradient of each
rank's shard of the sum is the gradient of the sum. Columns past the tokenizer's vocabulary
(padding rows of the embedding) are left out, so the numbers are the Hugging Face model's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mindspeed_llm.engine import ParallelLayout, megatron_to_hf, merge_tensors, plan_conversion, unwrap


def vocab_parallel_logp_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy from (vocab-parallel) ``logits`` (differentiable).

    Args:
        logits: ``[..., V_local]`` this rank's vocabulary columns (any float dtype).
        targets: ``[...]`` global token ids (any value where masked later; clamped here).
        vocab_start: the global id of this rank's first column.
        vocab_size: the real vocabulary (columns at or past it are padding and left out).
        group: the tensor-parallel group (None: the logits hold the whole vocabulary).

    Returns:
        float32 ``(logp, entropy)``, both shaped like ``targets``.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    parallel = group is not None and dist.get_world_size(group) > 1

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x) if parallel else x

    z = logits.float()
    local = z.shape[-1]
    # Without padding columns on this rank the masks below change nothing (bit for bit): three
    # passes over the logits and their backward saved.
    padded = vocab_start + local > vocab_size
    if padded:
        ids = torch.arange(vocab_start, vocab_start + local, device=z.device)
        valid = ids < vocab_size
        # Padding columns are zeroed (not -inf): exp and products stay finite, so no NaN gradients.
        z = torch.where(valid, z, torch.zeros((), dtype=z.dtype, device=z.device))
    with torch.no_grad():
        m = (z.masked_fill(~valid, float("-inf")) if padded else z).amax(-1, keepdim=True)
        if parallel:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m) * valid if padded else torch.exp(z - m)
    total = reduce(e.sum(-1))
    log_z = m.squeeze(-1) + torch.log(total)
    entropy = log_z - reduce((e * z).sum(-1)) / total
    local_target = targets.clamp(min=0) - vocab_start
    mine = (local_target >= 0) & (local_target < local)
    picked = z.gather(-1, local_target.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * mine
    logp = reduce(picked) - log_z
    return logp, entropy


def broadcast_from_stage(tensor: torch.Tensor, stage: int, group: Any) -> torch.Tensor:
    """``tensor`` of pipeline ``stage`` on every stage (in place into a same-shaped buffer elsewhere)."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, stage), group=group)
    return tensor


def gather_hf_state(
    chunks: list[Any], bridge: Any, shape: Any, tp: int, pp: int, hf_vocab: int, groups: Any, dualpipev: bool = False
) -> dict[str, torch.Tensor]:
    """The full model under Hugging Face names on every rank (collective over TP and PP).

    Each stage merges the tensor-parallel pieces of the parameters it holds (by the bridges'
    rules; local layer ``i`` of stage ``s`` is global layer ``offset(s) + i``, as
    :meth:`ParallelLayout.place` says); the stages then broadcast their tensors over the
    pipeline group, so every rank returns the same state.

    Args:
        chunks: this rank's model chunks (DDP-wrapped or not).
        bridge, shape: the model's bridge and shape (``read_hf_shape``).
        tp, pp: the layout.
        hf_vocab: the tokenizer's vocabulary (padding rows are cut off).
        groups: the process groups (a megatron ``ProcessGroupCollection``: ``tp``, ``pp``).
        dualpipev: the chunks are DualPipeV's V (two per rank, :class:`ParallelLayout` ``dualpipev``).
    """

    plan = plan_conversion(bridge, shape)
    layout = ParallelLayout(tp=tp, pp=pp, dualpipev=dualpipev)
    stage = groups.pp.rank() if pp > 1 else 0
    states = [
        {n: t.detach() for n, t in unwrap(c).state_dict().items() if not n.endswith("_extra_state")} for c in chunks
    ]
    owners = {name: layout.place(param, shape)[0] for name, param in plan.params.items()}
    mine: dict[str, torch.Tensor] = {}
    for name, param in plan.params.items():
        piece = owners[name]
        if piece.rank.pp != stage:
            continue
        local = states[piece.chunk][piece.name].contiguous()
        if tp == 1:
            full = local
        else:
            pieces = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(pieces, local, group=groups.tp)
            full = merge_tensors(param, pieces)  # cuts the vocabulary's padding rows off
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[:hf_vocab]
        mine[name] = full
    if pp == 1:
        return megatron_to_hf(plan, mine)
    group = groups.pp
    metas: list[Any] = [None] * pp
    dist.all_gather_object(metas, {n: (tuple(t.shape), t.dtype) for n, t in mine.items()}, group=group)
    full_state: dict[str, torch.Tensor] = {}
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    for src, meta in enumerate(metas):
        for name, (size, dtype) in meta.items():
            buffer = mine[name] if src == stage else torch.empty(size, dtype=dtype, device=device)
            full_state[name] = broadcast_from_stage(buffer.contiguous(), src, group)
    return megatron_to_hf(plan, full_state)
