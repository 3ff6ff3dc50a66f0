"""``attention`` on NVIDIA GPUs through flash-attn 2 (``flash_attn_func`` / ``flash_attn_varlen_func``).

flash-attn shares the op's conventions: BSND layout, GQA with consecutive q heads per kv head,
bottom-right aligned causal masks, ``window_size=(left, right)`` with ``-1`` unbounded, and
packed sequences through ``cu_seqlens``, and ALiBi through ``alibi_slopes`` (fp32, one per head,
the bias ``-slope * |i + seq_k - seq_q - j|``). Two gaps are closed here:

- its ``softmax_lse`` gets no gradient from flash-attn's autograd (its backward ignores that
  output), which ring attention needs: :func:`attach_lse_grad` adds it with two more
  flash-attn calls in the backward;
- it runs fp16/bf16 with head dim <= 256 on CUDA tensors only: other inputs fall back to
  ``sdpa`` (or to the reference when ``lse`` is asked for), logged once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from collections.abc import Sequence

import torch

from mindspeed.log import get_logger, log_once
from mindspeed.ops.attention import (
    FEATURE_ALIBI,
    FEATURE_LSE,
    FEATURE_VARLEN,
    FEATURE_WINDOW,
    attach_lse_grad,
    attention_reference,
    attention_sdpa,
    attention_with_sinks,
    check_attention_inputs,
    num_empty_rows,
)
from mindspeed.ops.registry import register_kernel

logger = get_logger(__name__)

#: flash-attn 2.6 is the first release with every argument used here and unpadded varlen lse.
MIN_VERSION = (2, 6)
_MAX_HEAD_DIM = 256


def _flash_attn_usable() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    release = importlib.metadata.version("flash_attn").split("+")[0].split(".")
    return tuple(int(part) for part in release[:2]) >= MIN_VERSION


def _flash_window(causal: bool, window_size: Sequence[int]) -> tuple[int, int]:
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


@register_kernel(
    "attention",
    "flash_attn",
    devices=("cuda",),
    priority=20,
    available=_flash_attn_usable,
    features=(FEATURE_LSE, FEATURE_WINDOW, FEATURE_VARLEN, FEATURE_ALIBI),
)
def attention_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: Sequence[int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash-attn 2; same arguments and results as :func:`mindspeed.ops.attention.attention_reference`
    (``sinks`` through flash-attn's log-sum-exp, :func:`mindspeed.ops.attention.apply_sinks`)."""
    kwargs = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        cu_seqlens=cu_seqlens,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    supported = (
        q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] <= _MAX_HEAD_DIM
    )
    if not supported:
        fallback = attention_reference if return_lse else attention_sdpa
        log_once(
            logger,
            f"attention[flash_attn]: {q.dtype} head dim {q.shape[-1]} on {q.device.type} is not supported by "
            f"flash-attn (fp16/bf16, head dim <= {_MAX_HEAD_DIM}); using {fallback.__name__}",
        )
        return fallback(q, k, v, return_lse=return_lse, **kwargs)
    return flash_attention(q, k, v, return_lse=return_lse, **kwargs)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: Sequence[int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The flash-attn calls, for inputs flash-attn supports (no dtype or device checks here)."""
    if sinks is not None:
        kwargs = dict(
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            cu_seqlens=cu_seqlens,
            alibi_slopes=alibi_slopes,
        )
        return attention_with_sinks("flash_attn", flash_attention, q, k, v, sinks, return_lse=return_lse, **kwargs)
    check_attention_inputs(q, k, v, window_size, cu_seqlens, alibi_slopes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    call = dict(softmax_scale=scale, causal=causal, window_size=_flash_window(causal, window_size))
    if alibi_slopes is not None:  # flash-attn takes fp32 slopes on the inputs' device
        call["alibi_slopes"] = alibi_slopes.to(device=q.device, dtype=torch.float32)

    if cu_seqlens is None:
        from flash_attn import flash_attn_func

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return flash_attn_func(q_, k_, v_, dropout_p=0.0, **call)

        if not return_lse:
            return attend(q, k, v)
        # dropout_p == 0, so the third result (the probabilities) is not computed.
        out, lse, _ = flash_attn_func(q, k, v, dropout_p=0.0, return_attn_probs=True, **call)
    else:
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max().item())
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, **call)

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            # batch == 1: the packed tokens are the sequence dim; TND is BSND without the B.
            return flash_attn_varlen_func(q_[0], k_[0], v_[0], dropout_p=0.0, **varlen).unsqueeze(0)

        if not return_lse:
            return attend(q, k, v)
        out, lse, _ = flash_attn_varlen_func(q[0], k[0], v[0], dropout_p=0.0, return_attn_probs=True, **varlen)
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)  # lse (heads, total) -> [1, heads, total]

    seq_q = q.shape[1]
    empty = num_empty_rows(seq_q, k.shape[1], causal=causal, window_size=window_size)
    if empty:
        # flash-attn gives rows without keys lse = +inf (and zero output); the op says -inf.
        rows = torch.arange(seq_q, device=q.device) < empty
        lse = lse.masked_fill(rows[None, None, :], float("-inf"))
        out = out.masked_fill(rows[None, :, None, None], 0)
    return out, attach_lse_grad(lse.float(), q, k, attend, scale)
