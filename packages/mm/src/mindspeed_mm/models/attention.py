"""The core's attention inside transformers models, through transformers' attention-function registry.

:func:`register_attention` adds ``mindspeed`` to transformers' ``AttentionInterface`` (the seam
every transformers model calls its attention through; no module of theirs is edited). A model
loaded with ``attn_implementation="mindspeed"`` then runs the kernel registry's ``attention``
op (:mod:`mindspeed.ops.attention`: SDPA, flash-attn or the NPU fused kernel, whichever the
accelerator has) in every attention layer:

- the trainer passes a :class:`PackedAttention` with the packed row's sample boundaries
  (``cu_seqlens``) to the language model; the kernel keeps attention inside each sample
  without the dense ``[L, L]`` mask that transformers builds for packed ``position_ids``
  (``mindspeed``'s mask function builds a mask only for a padding ``attention_mask``);
- with a Ulysses group in it, each rank holds a contiguous shard of the sequence, and the
  core's Ulysses all-to-all (:func:`mindspeed.parallel.context_parallel.ulysses.ulysses_attention`)
  gives each rank all the sequence for its share of the heads around the same kernel;
- without one (the vision encoders' non-causal attention, or a plain forward) it attends over
  the whole row, causal as the module says; an explicit mask or attention dropout goes to
  transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mindspeed.device import get_accelerator
from mindspeed.ops import resolve_kernel
from mindspeed.ops.attention import FEATURE_VARLEN, FEATURE_WINDOW
from mindspeed.parallel.context_parallel.ulysses import ulysses_attention

#: The name models are loaded with (``model.attn_implementation``).
ATTENTION_NAME = "mindspeed"

#: The keyword the trainer passes the :class:`PackedAttention` under (transformers forwards it to every layer's attention).
CONTEXT_KWARG = "mindspeed_attention"


@dataclass(frozen=True)
class PackedAttention:
    """What the attention of one packed microbatch needs beyond q, k and v.

    Attributes:
        cu_seqlens: int32 ``[samples + 1]`` boundaries of the samples in the whole (unsplit) row.
        seq_len: length of the whole row.
        group: the Ulysses (sequence-parallel) group; None: no sequence parallelism.
    """

    cu_seqlens: torch.Tensor
    seq_len: int
    group: dist.ProcessGroup | None = None


@functools.lru_cache(maxsize=8)
def _kernel(features: tuple[str, ...], device: str) -> Any:
    return resolve_kernel("attention", "auto", device=device, features=features)


def mindspeed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[b, heads, s, d]`` in, ``[b, s, heads, d]`` out.

    Uses ``kwargs[CONTEXT_KWARG]`` (a :class:`PackedAttention`) when the caller passed one.
    """
    context: PackedAttention | None = kwargs.get(CONTEXT_KWARG)
    if attention_mask is not None or dropout > 0.0:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if context is not None and context.group is not None:
            raise ValueError(
                "sequence parallelism needs attention without an explicit mask or dropout; set the "
                "model's attention_dropout to 0"
            )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            sliding_window=sliding_window,
            **kwargs,
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # BSND, the core's layout
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    if context is None or not causal:
        features = (FEATURE_WINDOW,) if sliding_window else ()
        out = _kernel(features, get_accelerator().name)(
            q, k, v, causal=causal, softmax_scale=scaling, window_size=window
        )
        return out, None
    features = (FEATURE_VARLEN, FEATURE_WINDOW) if sliding_window else (FEATURE_VARLEN,)
    attend = _kernel(features, get_accelerator().name)
    cu_seqlens = context.cu_seqlens.to(q.device)
    if context.group is None:
        return attend(q, k, v, causal=True, softmax_scale=scaling, window_size=window, cu_seqlens=cu_seqlens), None
    if sliding_window:
        raise ValueError(
            "sequence parallelism does not support sliding-window attention yet; set parallel.ulysses_parallel_size=1"
        )
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ulysses_attention(
        q,
        k,
        v,
        group=context.group,
        seq_len=context.seq_len,
        causal=True,
        softmax_scale=scale,
        cu_seqlens=cu_seqlens,
        attend=attend,
    )
    return out, None


def _padding_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask where a padding mask is given (batched generation), else none (see the module doc)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_attention() -> str:
    """Add ``mindspeed`` to transformers' attention-function and mask registries (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, mindspeed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)
    return ATTENTION_NAME
