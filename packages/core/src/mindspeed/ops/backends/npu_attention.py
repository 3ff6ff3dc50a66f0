"""``attention`` on Ascend NPUs through ``torch_npu.npu_fusion_attention``.

Masks map onto the kernel's ``sparse_mode`` (CANN FlashAttentionScore):

- causal, no left bound: ``sparse_mode=3`` (rightDownCausal, aligned bottom-right like the op);
- any window (with or without causal): ``sparse_mode=4`` (band, also anchored bottom-right),
  keys from ``pos - pre_tockens`` to ``pos + next_tockens``;
- no mask: ``sparse_mode=0`` without ``atten_mask``.

Modes 3 and 4 read a fixed, compressed 2048 x 2048 upper-triangular ``atten_mask`` (True =
masked) whatever the sequence lengths. Packed sequences use the ``"TND"`` layout with the
cumulative ends in ``actual_seq_qlen`` / ``actual_seq_kvlen``. The kernel returns
``softmax_max`` and ``softmax_sum`` (``[B, N, S, 8]``, or ``[T, N, 8]`` for TND, the 8 copies
equal) of the scaled scores, so ``lse = max + log(sum)``; it gets its gradient from
:func:`attach_lse_grad`, since the kernel's autograd only differentiates the output.

``ring_attention_update`` has no NPU kernel here, on purpose: ``torch_npu.npu_ring_attention_update``
takes ``softmax_max``/``softmax_sum`` pairs whose max must be positive (per its documentation) and
has no backward. The op's ``lse`` of a key block is often negative and is ``-inf`` on rows without
keys, so no (max, sum) re-encoding of it is exact, and the fused kernel would also need the
BSND -> SBH copies and an autograd wrapper; the fp32 reference (or its ``compile`` impl) is
exact and is already one elementwise pass.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import torch

from mindspeed.ops.attention import (
    FEATURE_LSE,
    FEATURE_VARLEN,
    FEATURE_WINDOW,
    attach_lse_grad,
    attention_with_sinks,
    check_attention_inputs,
    num_empty_rows,
)
from mindspeed.ops.registry import register_kernel

#: Side of the compressed causal mask that sparse modes 2, 3 and 4 require.
_MASK_SIZE = 2048
_SPARSE_DEFAULT, _SPARSE_RIGHT_DOWN_CAUSAL, _SPARSE_BAND = 0, 3, 4
#: inner_precise=2 asks the kernel to compute rows that are masked entirely (rows without keys).
_INNER_PRECISE_INVALID_ROWS = 2

_masks: dict[str, torch.Tensor] = {}


def _torch_npu_usable() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _compressed_mask(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _masks:
        _masks[key] = torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)
    return _masks[key]


def _sparse_args(
    seq_q: int, seq_k: int, causal: bool, window_size: Sequence[int], device: torch.device
) -> dict[str, Any]:
    left, right = (int(w) for w in window_size)
    if causal and left < 0:
        return {"sparse_mode": _SPARSE_RIGHT_DOWN_CAUSAL, "atten_mask": _compressed_mask(device)}
    if causal or left >= 0 or right >= 0:
        unbounded = seq_q + seq_k  # reaches every key; keeps the values far from int overflow
        return {
            "sparse_mode": _SPARSE_BAND,
            "atten_mask": _compressed_mask(device),
            "pre_tockens": left if left >= 0 else unbounded,
            "next_tockens": 0 if causal else (right if right >= 0 else unbounded),
        }
    return {"sparse_mode": _SPARSE_DEFAULT}


@register_kernel(
    "attention",
    "npu",
    devices=("npu",),
    priority=20,
    available=_torch_npu_usable,
    features=(FEATURE_LSE, FEATURE_WINDOW, FEATURE_VARLEN),
)
def attention_npu(
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
    """``npu_fusion_attention``; same arguments and results as :func:`mindspeed.ops.attention.attention_reference`
    (``sinks`` through the kernel's log-sum-exp, :func:`mindspeed.ops.attention.apply_sinks`).

    ALiBi is not mapped onto the kernel's ``pse`` input yet: it raises, and resolving the op
    with ``features=("alibi",)`` on an NPU picks the ``sdpa`` kernel instead.
    """
    import torch_npu

    if alibi_slopes is not None:
        raise ValueError("attention impl 'npu' does not take alibi_slopes yet; resolve the op with features=('alibi',)")
    if sinks is not None:
        kwargs = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, cu_seqlens=cu_seqlens)
        return attention_with_sinks("npu", attention_npu, q, k, v, sinks, return_lse=return_lse, **kwargs)

    check_attention_inputs(q, k, v, window_size, cu_seqlens)
    seq_q, heads = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    empty = num_empty_rows(seq_q, k.shape[1], causal=causal, window_size=window_size)
    common: dict[str, Any] = {
        "scale": scale,
        "keep_prob": 1.0,
        **_sparse_args(seq_q, k.shape[1], causal, window_size, q.device),
    }
    if empty:
        common["inner_precise"] = _INNER_PRECISE_INVALID_ROWS

    # What the kernel leaves in rows without keys is unspecified; the op says output 0, lse -inf.
    rows = torch.arange(seq_q, device=q.device) < empty if empty else None

    def zero_empty_rows(out: torch.Tensor) -> torch.Tensor:
        return out if rows is None else out.masked_fill(rows[None, :, None, None], 0)

    if cu_seqlens is None:

        def fused(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> tuple:
            return torch_npu.npu_fusion_attention(q_, k_, v_, heads, "BSND", **common)

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return zero_empty_rows(fused(q_, k_, v_)[0])

    else:
        ends = cu_seqlens[1:].tolist()  # the kernel takes the cumulative ends, without the leading 0

        def fused(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> tuple:
            # batch == 1: TND is BSND without the B.
            return torch_npu.npu_fusion_attention(
                q_[0], k_[0], v_[0], heads, "TND", actual_seq_qlen=ends, actual_seq_kvlen=ends, **common
            )

        def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return fused(q_, k_, v_)[0].unsqueeze(0)  # packed sequences have no empty rows

    result = fused(q, k, v)
    softmax_max, softmax_sum = result[1], result[2]
    out = zero_empty_rows(result[0] if cu_seqlens is None else result[0].unsqueeze(0))
    if not return_lse:
        return out

    lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    if cu_seqlens is not None:
        lse = lse.transpose(0, 1).unsqueeze(0)  # [T, N] -> [1, N, T]
    if rows is not None:
        lse = lse.masked_fill(rows[None, None, :], float("-inf"))
    return out, attach_lse_grad(lse, q, k, attend, scale)
