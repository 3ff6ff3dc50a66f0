"""Shared-prefix packing: one prompt, encoded once, followed by several responses to it.

A GRPO group is ``G`` responses to one prompt. Packed as ordinary THD segments
``[prompt, r_j]`` the prompt runs ``G`` times through every layer. Packed as one segment
``[prompt, r_1, ..., r_G]`` it runs once, if

* each response attends to the prompt and causally to itself, never to another response
  (:func:`attend_shared_prefix`), and
* each response's rotary positions continue from the prompt's end: ``r_j[i]`` sits at position
  ``len(prompt) + i``, as in its own ``[prompt, r_j]`` sequence. Megatron's THD rope numbers
  positions per ``cu_seqlens`` segment, so the positions travel per token: the
  ``rope-token-positions`` patch (:func:`token_position_preprocess`) gathers the rope
  frequencies of :attr:`SharedPrefixParams.token_positions` and megatron-core's THD rope applies
  per-token frequencies as given (its "exact mapping" case, ``freqs.size(0) == cu_seqlens[-1]``).

The gradients of every response flow into the prompt's keys and values (they are concatenated
to each response's own, not detached), so the update's gradients equal the unshared packing's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

#: Position-embedding types whose positions this packing carries: megatron's rope (per-token
#: frequencies, by the patch) and learned absolute embeddings (which read ``position_ids``).
SUPPORTED_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """THD params of a microbatch packed as shared-prefix groups ``[prompt, r_1, ..., r_G]``.

    ``cu_seqlens_q`` / ``cu_seqlens_kv`` bound the groups (one segment per group) and
    ``max_seqlen_q`` / ``max_seqlen_kv`` are the longest ``prompt + response`` (the rope table's
    length).

    Attributes:
        token_positions: ``[T]`` long: each token's position in its own ``[prompt, r_j]`` sequence.
        groups: per group, in token order, ``(prompt length, (response lengths ...))`` (host ints:
            the attention's shapes are known without a device sync).
    """

    token_positions: torch.Tensor | None = None
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()


def shared_prefix_params(groups: Sequence[tuple[int, Sequence[int]]], device: Any = None) -> SharedPrefixParams:
    """The params of groups packed in order, each as ``[prompt, r_1, ..., r_G]``.

    Args:
        groups: per group ``(prompt length, response lengths)``; prompts and responses non-empty.
        device: where the tensors go.

    Raises:
        ValueError: an empty prompt or response, or a group without responses.
    """
    bounds, positions, layout, longest = [0], [], [], 0
    for prompt, responses in groups:
        responses = tuple(int(n) for n in responses)
        if prompt < 1 or not responses or min(responses) < 1:
            raise ValueError(
                f"a shared-prefix group needs a non-empty prompt and non-empty responses; got prompt length "
                f"{prompt}, response lengths {list(responses)}"
            )
        positions.append(torch.arange(prompt))
        positions.extend(torch.arange(prompt, prompt + n) for n in responses)
        bounds.append(bounds[-1] + prompt + sum(responses))
        layout.append((int(prompt), responses))
        longest = max(longest, prompt + max(responses))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return SharedPrefixParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        token_positions=torch.cat(positions).to(device),
        groups=tuple(layout),
    )


def attend_shared_prefix(
    kernel: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    params: SharedPrefixParams,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Attention of shared-prefix groups: the prompt causally, each response on the prompt and itself.

    Per group, two calls of the attention ``kernel`` (the registry's ``attention`` op, BSND):
    the prompt's ``P`` queries causally on its keys, and the ``G`` responses batched as
    ``[G, R, heads, dim]`` queries (right-padded to the longest ``R``) against
    ``[G, P + R, heads_kv, dim]`` keys: the prompt's, shared by all, then the response's own. The
    op's causal mask is bottom-right aligned, so query ``i`` sees the prompt and its own first
    ``i + 1`` tokens; the padding sits after every real key of a row, so real rows never see it.

    Args:
        kernel: ``kernel(q, k, v, causal=..., softmax_scale=...)`` on ``[b, s, heads, dim]``.
        query, key, value: ``[T, heads, dim]`` (megatron's THD, after rope).
        params: the layout (:func:`shared_prefix_params`).
        softmax_scale: the scores' scale (default ``1 / sqrt(dim)``).

    Returns:
        ``[T, heads, dim]`` in token order.
    """
    pieces, start = [], 0
    for prompt, responses in params.groups:
        stop = start + prompt
        q_p, k_p, v_p = query[start:stop], key[start:stop], value[start:stop]
        pieces.append(kernel(q_p[None], k_p[None], v_p[None], causal=True, softmax_scale=softmax_scale)[0])
        count, width = len(responses), max(responses)
        offset = stop + sum(responses)
        equal = min(responses) == width
        if equal:
            # Responses of one length (GRPO with a fixed budget): [G, R] is a reshape of the tokens, and
            # the output one block: no gathers, and no G zero-padded slices summed in the backward.
            q_r, k_new, v_new = (x[stop:offset].reshape(count, width, *x.shape[1:]) for x in (query, key, value))
        else:
            index, first = [], stop
            for n in responses:
                # Padding rows repeat the response's last token: in range, never seen by a real row.
                index.append(torch.arange(first, first + width, device=query.device).clamp_max(first + n - 1))
                first += n
            rows = torch.stack(index)  # [G, R]
            q_r, k_new, v_new = query[rows], key[rows], value[rows]
        k_r = torch.cat([k_p[None].expand(count, -1, -1, -1), k_new], dim=1)
        v_r = torch.cat([v_p[None].expand(count, -1, -1, -1), v_new], dim=1)
        out = kernel(q_r, k_r, v_r, causal=True, softmax_scale=softmax_scale)  # [G, R, heads, dim]
        flat = out.reshape(count * width, *out.shape[2:])
        if equal:
            pieces.append(flat)
        else:  # the real rows in one gather (its backward one scatter, not G zero-padded slices)
            real = [j * width + i for j, n in enumerate(responses) for i in range(n)]
            pieces.append(flat[torch.tensor(real, device=query.device)])
        start = offset
    if start != query.shape[0]:
        raise ValueError(f"the shared-prefix groups cover {start} tokens but the microbatch has {query.shape[0]}")
    return torch.cat(pieces)


def token_position_preprocess(original: Any, acc: Any = None) -> Any:
    """``GPTModel._preprocess`` whose rope frequencies follow per-token positions of shared-prefix params.

    Megatron builds the rope table for positions ``0 .. max_seqlen - 1`` and, in THD, numbers each
    ``cu_seqlens`` segment from 0. With :class:`SharedPrefixParams` the table is gathered at
    ``token_positions`` (``[T, 1, 1, dim]``); megatron's THD rope then applies row ``t`` to token
    ``t``. Other params pass through unchanged.
    """

    def _preprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        params = kwargs.get("packed_seq_params")
        if not isinstance(params, SharedPrefixParams):
            return out
        kind = self.position_embedding_type
        if kind not in SUPPORTED_POSITION_EMBEDDINGS or self.config.multi_latent_attention:
            raise ValueError(
                f"shared-prefix packing supports position embeddings {SUPPORTED_POSITION_EMBEDDINGS} without "
                f"multi-latent attention; this model has {kind!r}: pack each sequence on its own"
            )
        table = out[1]
        if kind != "rope" or table is None:
            return out
        return (out[0], table[params.token_positions], *out[2:])

    return _preprocess
