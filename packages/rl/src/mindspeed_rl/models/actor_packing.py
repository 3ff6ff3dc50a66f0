"""THD microbatches of the actor's ``(prompt ids, response ids)`` pairs.

Two packings, with the same per-pair outputs:

* :func:`pack_pairs`: each pair is its own segment ``[prompt, response]``;
* :func:`pack_shared_prompts`: pairs with identical prompt ids form one segment
  ``[prompt, r_1, ..., r_G]`` (:mod:`mindspeed.megatron.shared_prefix`), so a GRPO group runs
  its prompt through the model once instead of ``G`` times.

Both return ``resp_index`` ``[n, width]`` (the packed position whose output predicts each
response token), ``resp_targets`` (the token it predicts) and ``resp_mask``, rows in pair order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mindspeed.megatron.modules import RegistryAttention
from mindspeed.megatron.shared_prefix import SUPPORTED_POSITION_EMBEDDINGS, shared_prefix_params
from mindspeed.model.shape import ModelShape
from mindspeed_llm.engine import PackSettings, pack_microbatch

IGNORE_INDEX = -100

Pair = tuple[Sequence[int], Sequence[int]]


def _response_rows(pairs: Sequence[Pair], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(pairs)
    index, targets = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    for row, (_, response) in enumerate(pairs):
        targets[row, : len(response)] = torch.as_tensor(list(response), dtype=torch.long)
        mask[row, : len(response)] = 1.0
    return index, targets, mask


def pack_pairs(pairs: Sequence[Pair], width: int, settings: PackSettings) -> dict[str, Any]:
    """One THD microbatch with each pair as its own segment ``[prompt, response]``."""
    seqs = []
    index, targets, mask = _response_rows(pairs, width)
    offset = 0
    for row, (prompt, response) in enumerate(pairs):
        ids = np.asarray([*prompt, *response], dtype=np.int64)
        labels = ids.copy()
        labels[: len(prompt)] = IGNORE_INDEX
        seqs.append((ids, labels))
        # Position t predicts token t + 1: response token j sits at len(prompt) - 1 + j.
        index[row, : len(response)] = offset + len(prompt) - 1 + torch.arange(len(response))
        offset += len(ids)
    batch = pack_microbatch(seqs, settings)
    batch["resp_index"], batch["resp_targets"], batch["resp_mask"] = index, targets, mask
    return batch


def pack_shared_prompts(pairs: Sequence[Pair], width: int, device: Any = None) -> dict[str, Any]:
    """One THD microbatch with the pairs grouped by prompt: ``[prompt, r_1, ..., r_G]`` per group.

    Groups are in the order of their first pair; a lone pair is a group of one. The first token
    of every response is predicted by the prompt's last position (one position, ``G`` targets),
    so the microbatch has no per-position ``labels``: the caller takes log-probs from the
    logits at ``resp_index`` against ``resp_targets``.

    Args:
        pairs: ``(prompt ids, response ids)``, prompts and responses non-empty.
        width: columns of the per-pair rows (at least the longest response).
        device: where the tensors go.

    Returns:
        ``tokens`` and ``position_ids`` ``[1, T]`` (positions within each pair's own sequence),
        ``packed_seq_params`` (:class:`~mindspeed.megatron.shared_prefix.SharedPrefixParams`),
        ``resp_index``, ``resp_targets`` and ``resp_mask`` ``[n, width]``.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (prompt, _) in enumerate(pairs):
        groups.setdefault(tuple(map(int, prompt)), []).append(row)
    index, targets, mask = _response_rows(pairs, width)
    tokens: list[int] = []
    layout = []
    for prompt, rows in groups.items():
        if not prompt:
            raise ValueError("a pair has an empty prompt: the actor needs at least one prompt token per pair")
        tokens.extend(prompt)
        last = len(tokens) - 1  # the prompt's last position predicts every response's first token
        for row in rows:
            response = pairs[row][1]
            n = len(response)
            index[row, 0] = last
            index[row, 1:n] = len(tokens) + torch.arange(n - 1)
            tokens.extend(map(int, response))
        layout.append((len(prompt), [len(pairs[row][1]) for row in rows]))
    params = shared_prefix_params(layout, device)
    return {
        "tokens": torch.tensor(tokens, dtype=torch.long, device=device)[None],
        "position_ids": params.token_positions[None],
        "packed_seq_params": params,
        "resp_index": index.to(device),
        "resp_targets": targets.to(device),
        "resp_mask": mask.to(device),
    }


def resolve_share_prompt(requested: bool | None, pp: int, shape: ModelShape, chunks: Sequence[Any]) -> bool:
    """``actor.share_prompt`` against what the layout and the model allow.

    Args:
        requested: the setting (None: on where allowed; True: on, or a ``ValueError`` naming
            what prevents it; False: off).
        pp: the pipeline stages. shape: the model. chunks: its built chunks (their attention).
    """
    if requested is False:
        return False
    blockers = []
    if pp > 1:
        blockers.append(f"pp={pp} (pipeline stages exchange fixed-shape microbatches)")
    if shape.position_embedding_type not in SUPPORTED_POSITION_EMBEDDINGS:
        blockers.append(f"position embedding {shape.position_embedding_type!r}")
    if shape.multi_latent_attention or shape.mtp_num_layers:
        blockers.append("multi-latent attention or multi-token prediction")
    attention = [m for c in chunks for n, m in c.named_modules() if n.endswith("core_attention")]
    if not attention or not all(isinstance(m, RegistryAttention) for m in attention):
        blockers.append("the core attention is not mindspeed's RegistryAttention")
    if blockers and requested:
        raise ValueError(
            f"actor.share_prompt=true cannot apply with {'; '.join(blockers)}; "
            "set actor.share_prompt=false or leave it unset"
        )
    return not blockers


def pack_microbatches(
    pairs: Sequence[Pair],
    width: int,
    micro_batch_size: int,
    pp: int,
    share_prompt: bool,
    device: Any,
    extra: dict[str, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """THD microbatches of ``pairs`` on ``device`` with ``resp_index`` [n, width] into the packed tokens.

    ``extra`` holds per-pair tensors ``[len(pairs), width]`` (old log-probs, advantages, ...)
    that are cut into the microbatches alongside. With ``share_prompt`` the pairs of a
    microbatch that share their prompt ids are packed as one shared-prefix segment.
    """
    mbs = micro_batch_size
    longest = max(len(p) + len(r) for p, r in pairs)
    # Pipeline stages exchange activations of one fixed shape: with pp > 1 every microbatch
    # is padded to mbs * longest tokens (megatron's variable_seq_lengths would need the
    # alltoall token dispatcher, and a shape handshake per microbatch).
    settings = PackSettings(seq_length=longest, micro_batch_size=mbs, variable=pp == 1)
    out = []
    for first in range(0, len(pairs), mbs):
        group = pairs[first : first + mbs]
        if share_prompt:
            batch = pack_shared_prompts(group, width, device)
        else:
            batch = pack_pairs(group, width, settings)
        for key, value in (extra or {}).items():
            batch[key] = value[first : first + mbs]
        out.append({k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()})
    return out
