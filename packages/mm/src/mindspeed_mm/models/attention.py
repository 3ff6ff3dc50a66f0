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

Vision towers that attend within windows or images of a packed row (Qwen2.5-VL, Qwen3-VL)
hand their boundaries (``cu_seq_lens_q``) to the attention function only when its name says
``flash``; under any other name transformers splits the row and calls the function once per
window. :func:`use_varlen_vision` gives the model's vision sub-config the name
``mindspeed_flash_varlen`` (registered next to ``mindspeed``; set after loading, so
transformers never looks for a flash-attn package), whose function runs all windows in one
call of the kernel registry's varlen ``attention`` (equal windows batched without padding).
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

#: The name the vision sub-config gets (:func:`use_varlen_vision`): "flash" makes transformers pass ``cu_seq_lens_q``.
VARLEN_NAME = "mindspeed_flash_varlen"

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


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`mindspeed_attention` with transformers' flash-style ``cu_seq_lens_q``: one varlen kernel call.

    Attention within each segment of ``cu_seq_lens_q`` (a vision tower's windows or images)
    runs as one call of the registry's varlen ``attention``; without boundaries this is
    :func:`mindspeed_attention`.

    Raises:
        ValueError: boundaries together with a mask, dropout or other key boundaries.
    """
    kwargs.pop("max_length_q", None), kwargs.pop("max_length_k", None)
    if cu_seq_lens_q is None:
        return mindspeed_attention(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if (
        attention_mask is not None
        or dropout > 0.0
        or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q))
    ):
        raise ValueError(
            f"{VARLEN_NAME} attention takes equal query and key boundaries without a mask or dropout; "
            f"load the model with attn_implementation={ATTENTION_NAME!r} and its attention dropout at 0"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # BSND, the core's layout
    attend = _kernel((FEATURE_VARLEN,), get_accelerator().name)
    return attend(q, k, v, causal=causal, softmax_scale=scaling, cu_seqlens=cu_seq_lens_q.to(torch.int32)), None


def use_varlen_vision(model: torch.nn.Module) -> bool:
    """Give a ``mindspeed`` model's vision sub-config :data:`VARLEN_NAME` (see the module doc); returns whether it did.

    The language model keeps ``mindspeed``. A model without a ``vision_config``, or loaded
    with another attention, is left as it is.
    """
    vision = getattr(model.config, "vision_config", None)
    if vision is None or getattr(vision, "_attn_implementation", None) != ATTENTION_NAME:
        return False
    vision._attn_implementation = VARLEN_NAME
    return True


def _padding_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask where a padding mask is given (batched generation), else none (see the module doc)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_attention() -> str:
    """Add ``mindspeed`` (and :data:`VARLEN_NAME`) to transformers' attention-function and mask registries (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, mindspeed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)
    AttentionInterface.register(VARLEN_NAME, varlen_attention)
    AttentionMaskInterface.register(VARLEN_NAME, _padding_mask)
    return ATTENTION_NAME
