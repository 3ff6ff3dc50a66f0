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

from mindspeed.megatron.shared_prefix import shared_prefix_params
from mindspeed_llm.training.finetune_data import PackSettings, pack_microbatch

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
