"""Scaled dot-product attention: ``attention``.

Layout BSND: ``q`` is ``[batch, seq_q, heads_q, dim]``, ``k`` and ``v`` are
``[batch, seq_k, heads_kv, dim]`` with ``heads_q % heads_kv == 0``; each kv head serves
``heads_q // heads_kv`` consecutive q heads (grouped-query attention, as Hugging Face's
``repeat_kv`` and Megatron do it).

Masks follow flash-attn's conventions so that every backend agrees:

- query ``i`` sits at key position ``i + seq_k - seq_q`` (bottom-right alignment), which is
  what KV-cache decoding and ring attention need when ``seq_q != seq_k``;
- ``causal`` keeps keys at or before that position;
- ``window_size=(left, right)`` keeps keys within ``left`` before and ``right`` after it
  (``-1``: unbounded); a Mistral sliding window of ``W`` tokens is ``(W - 1, 0)``;
- ``cu_seqlens`` packs several sequences into one row (``batch == 1``, ``seq_q == seq_k``): a
  token sees only its own segment, and causal/window apply inside it;
- ``alibi_slopes`` (``[heads_q]`` fp32) adds ALiBi's ``-slope * |pos_q - pos_k|`` to the scaled
  scores (:mod:`mindspeed.ops.alibi`), inside each segment of packed sequences;
  ``alibi_offset`` (feature ``alibi_offset``) moves the queries by that many positions for the
  bias only (``pos_q = i + seq_k - seq_q + alibi_offset``; the masks keep the bottom-right
  alignment): a block of ring attention whose rows and keys lie apart in the whole sequence.

A query row that sees no key outputs zeros and has ``lse = -inf``; its gradients are zero.

Attention sinks (GPT-OSS): ``sinks`` is one learnable logit per query head, ``[heads_q]``. It
is one more column of every row's softmax, whose probability is then dropped (its value is
zero), so ``out = softmax([s, sink])[:-1] @ v``. The reference adds the column; a kernel with a
log-sum-exp gets the same result from its plain output, ``out * sigmoid(lse - sink)``
(:func:`apply_sinks`), and a kernel without one falls back to the reference (logged once). The
``lse`` an op returns is always that of the keys alone (the sink left out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed.log import get_logger, log_once
from mindspeed.ops.alibi import alibi_bias, check_alibi_slopes, get_alibi_slopes
from mindspeed.ops.mask_cache import shared_mask
from mindspeed.ops.registry import Case, OpSpec, Tolerance, register_kernel, register_op

logger = get_logger(__name__)

#: Optional features of the op (see ``Case.features`` and ``KernelImpl.features``).
FEATURE_LSE = "lse"
FEATURE_WINDOW = "window"
FEATURE_VARLEN = "varlen"
FEATURE_ALIBI = "alibi"
FEATURE_ALIBI_OFFSET = "alibi_offset"

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: Sequence[int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` with the fix when the inputs break the op's contract.

    Args:
        q: ``[batch, seq_q, heads_q, dim]``.
        k: ``[batch, seq_k, heads_kv, dim]``.
        v: same shape as ``k``.
        window_size: ``(left, right)``, each ``>= -1``.
        cu_seqlens: packed-sequence boundaries; checking their values reads them on the host
            (one small sync, only for packed sequences).
        alibi_slopes: ``[heads_q]`` float ALiBi slopes.
        sinks: ``[heads_q]`` per-head sink logits.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D BSND q, k, v; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree on batch and head dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with each >= -1 (-1 = unbounded); got {window_size}")
    if alibi_slopes is not None:
        check_alibi_slopes(alibi_slopes, q.shape[2])
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks must be one logit per query head, [{q.shape[2]}]; got {list(sinks.shape)}")
    if cu_seqlens is None:
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor; got {cu_seqlens.dtype}{list(cu_seqlens.shape)}")
    if q.shape[0] != 1 or q.shape[1] != k.shape[1]:
        raise ValueError(
            "packed sequences (cu_seqlens) need batch == 1 and seq_q == seq_k; "
            f"got q {list(q.shape)}, k {list(k.shape)}"
        )
    bounds = cu_seqlens.tolist()
    rising = all(a <= b for a, b in zip(bounds, bounds[1:]))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != q.shape[1] or not rising:
        raise ValueError(f"cu_seqlens must rise from 0 to seq_len={q.shape[1]}; got {bounds}")


def visible_keys_mask(
    seq_q: int,
    seq_k: int,
    *,
    causal: bool,
    window_size: Sequence[int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Which keys each query sees, from index arithmetic; built once per step and shared by the layers.

    Args:
        seq_q: number of queries.
        seq_k: number of keys.
        causal: keep keys at or before the query's (bottom-right aligned) position.
        window_size: ``(left, right)`` bounds around that position, ``-1`` = unbounded.
        cu_seqlens: segment boundaries of packed sequences (``seq_q == seq_k``).
        device: where to build the mask.

    Returns:
        A bool ``[seq_q, seq_k]`` mask (True = attend; shared: do not modify it), or ``None``
        when every key is visible.
    """
    left, right = (int(w) for w in window_size)
    if not causal and left < 0 and right < 0 and cu_seqlens is None:
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    return shared_mask(
        ("visible", seq_q, seq_k, causal, (left, right), device),
        cu_seqlens,
        lambda: _build_visible(seq_q, seq_k, causal, (left, right), cu_seqlens, device),
    )


def _build_visible(
    seq_q: int,
    seq_k: int,
    causal: bool,
    window_size: Sequence[int],
    cu_seqlens: torch.Tensor | None,
    device: torch.device | str | None,
) -> torch.Tensor:
    """The mask of :func:`visible_keys_mask`, freshly built (all True where nothing is hidden)."""
    left, right = (int(w) for w in window_size)
    q_pos = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
    k_pos = torch.arange(seq_k, device=device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if left >= 0:
        visible &= k_pos >= q_pos - left
    if right >= 0:
        visible &= k_pos <= q_pos + right
    if cu_seqlens is not None:
        # Segment id of every token: bucketize against the segment ends.
        ends = cu_seqlens[1:].to(device=device, dtype=torch.long)
        segment = torch.bucketize(torch.arange(seq_q, device=device), ends, right=True)
        visible &= segment[:, None] == segment[None, :]
    return visible


def num_empty_rows(seq_q: int, seq_k: int, *, causal: bool, window_size: Sequence[int] = (-1, -1)) -> int:
    """How many leading query rows see no key at all (the only rows that can be empty).

    Row ``i`` sees keys up to ``i + seq_k - seq_q + right`` (``right = 0`` under ``causal``),
    so it is empty exactly when that is negative; a left bound never empties a row.
    Packed sequences have ``seq_q == seq_k`` per segment and never have empty rows.

    Args:
        seq_q: number of queries.
        seq_k: number of keys.
        causal: whether the causal mask applies.
        window_size: ``(left, right)``, ``-1`` = unbounded.

    Returns:
        The number of empty rows; they are rows ``0 .. n - 1``.
    """
    right = int(window_size[1])
    if causal:
        right = 0
    elif right < 0:
        return 0
    return max(0, min(seq_q, seq_q - seq_k - right))


def attention_reference(
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
    alibi_offset: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with the whole score matrix materialised, in fp32.

    Args:
        q: ``[batch, seq_q, heads_q, dim]``.
        k: ``[batch, seq_k, heads_kv, dim]``, ``heads_q % heads_kv == 0``.
        v: same shape as ``k``.
        causal: bottom-right aligned causal mask.
        softmax_scale: score scale (default ``1 / sqrt(dim)``).
        window_size: ``(left, right)`` local window, ``-1`` = unbounded.
        cu_seqlens: ``[num_seqs + 1]`` cumulative boundaries of packed sequences (``batch == 1``).
        return_lse: also return the log-sum-exp of the scaled (and biased) scores.
        alibi_slopes: ``[heads_q]`` ALiBi slopes (see :mod:`mindspeed.ops.alibi`).
        sinks: ``[heads_q]`` sink logits: one more softmax column per row, dropped after the
            softmax (``None``: no sink).
        alibi_offset: ALiBi's query positions moved by this many keys (the bias only).

    Returns:
        The output ``[batch, seq_q, heads_q, dim]`` in ``q``'s dtype, and with ``return_lse``
        the fp32 ``lse`` ``[batch, heads_q, seq_q]`` of the keys alone (``-inf`` on rows that
        see no key).
    """
    check_attention_inputs(q, k, v, window_size, cu_seqlens, alibi_slopes, sinks)
    seq_q, heads_q, dim = q.shape[1], q.shape[2], q.shape[3]
    seq_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    group = heads_q // heads_kv

    # [b, n, s, d] in fp32; kv head h // group serves q head h.
    q32 = q.float().transpose(1, 2)
    k32 = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    v32 = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seq_q, seq_k, q.device, alibi_offset)
    elif alibi_offset:
        raise ValueError(f"alibi_offset={alibi_offset} without alibi_slopes; pass the slopes or leave the offset 0")
    visible = visible_keys_mask(
        seq_q, seq_k, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens, device=q.device
    )
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))

    # Softmax by hand so that rows without keys give 0 (not NaN) forward and backward: the
    # max of an empty row is -inf, so shift it by 0 instead and guard the division and log.
    # The shift is detached because the result does not depend on it.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    has_key = torch.isfinite(row_max)  # -inf: every key of the row is masked
    sink = None if sinks is None else sinks.float().view(1, heads_q, 1, 1)
    if sink is not None:  # the sink column takes part in the row's max
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(has_key, row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    keys = weights.sum(dim=-1, keepdim=True)
    total = keys if sink is None else keys + torch.exp(sink - row_max)
    total = torch.where(has_key, total, torch.ones_like(total))
    out = torch.matmul(weights / total, v32).transpose(1, 2).to(q.dtype)
    if not return_lse:
        return out
    keys = torch.where(has_key, keys, torch.ones_like(keys))
    lse = torch.where(has_key, row_max + torch.log(keys), float("-inf")).squeeze(-1)
    return out, lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks from attention without: ``out * sigmoid(lse - sink)``.

    With ``Z = exp(lse)`` the keys' softmax denominator, adding the sink column turns every
    probability ``p`` into ``p * Z / (Z + exp(sink))``. Rows without keys (``lse = -inf``) stay 0.

    Args:
        out: ``[batch, seq_q, heads_q, dim]`` attention output without sinks.
        lse: ``[batch, heads_q, seq_q]`` its log-sum-exp, differentiable in ``q`` and ``k``
            (see :func:`attach_lse_grad`).
        sinks: ``[heads_q]`` sink logits.

    Returns:
        The output with sinks, in ``out``'s dtype.
    """
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [b, n, s]
    return (out.float() * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype)


def attention_with_sinks(
    kernel_name: str, lse_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None, q, k, v, sinks, **kwargs
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A backend's attention with ``sinks``: through its log-sum-exp (:func:`apply_sinks`) when
    ``lse_kernel`` is given, else the reference (logged once, naming the backend and why).

    Args:
        kernel_name: the backend, for the log line.
        lse_kernel: the backend called with ``return_lse=True`` (a differentiable lse), or ``None``.
        q, k, v, sinks, **kwargs: the op's arguments (``return_lse`` among them).
    """
    return_lse = kwargs.pop("return_lse", False)
    if lse_kernel is None:
        log_once(
            logger,
            f"attention[{kernel_name}]: sinks need the keys' log-sum-exp, which this backend does not "
            "return; using attention_reference",
        )
        return attention_reference(q, k, v, sinks=sinks, return_lse=return_lse, **kwargs)
    out, lse = lse_kernel(q, k, v, return_lse=True, **kwargs)
    out = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


class _LseGrad(torch.autograd.Function):
    """Identity on a kernel's ``lse`` whose backward adds d lse / d (q, k).

    With ``P = softmax(scale * q k^T)`` (masked), ``d lse_i / d s_ij = P_ij``, so for a
    cotangent ``g``: ``dq_i = scale * g_i * (P k)_i`` and ``dk = scale * P^T (g * q)``. Both are
    attention calls: ``P k`` is the attention output with ``v = k``, and ``P^T x`` is that call's
    gradient with respect to ``v`` for the output cotangent ``x``. Any kernel can so supply the
    gradient that its own autograd drops.
    """

    @staticmethod
    def forward(ctx, lse, q, k, attend, scale):  # type: ignore[override]
        ctx.save_for_backward(lse, q, k)
        ctx.attend, ctx.scale = attend, scale
        return lse.clone()

    @staticmethod
    def backward(ctx, grad_lse):  # type: ignore[override]
        lse, q, k = ctx.saved_tensors
        # Rows that see no key have no gradient (their lse is -inf; some kernels say +inf).
        grad_lse = torch.where(torch.isfinite(lse), grad_lse, torch.zeros_like(grad_lse))
        row_grad = grad_lse.transpose(1, 2).unsqueeze(-1) * ctx.scale  # [b, s, n, 1]
        with torch.enable_grad():
            probe = k.detach().requires_grad_(True)
            pk = ctx.attend(q.detach(), k.detach(), probe)
            (grad_k,) = torch.autograd.grad(pk, probe, grad_outputs=(row_grad * q.float()).to(pk.dtype))
        grad_q = (row_grad * pk.detach().float()).to(q.dtype)
        return None, grad_q, grad_k.to(k.dtype), None, None


def attach_lse_grad(
    lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, attend: Attend, softmax_scale: float
) -> torch.Tensor:
    """Make a kernel's (non-differentiable) ``lse`` differentiable with respect to ``q`` and ``k``.

    Args:
        lse: ``[batch, heads_q, seq_q]`` fp32 log-sum-exp from the kernel (``-inf``/``+inf`` on
            rows without keys get no gradient).
        q: the query the kernel saw, BSND.
        k: the key the kernel saw, BSND.
        attend: ``attend(q, k, v) -> out``, the same kernel with the same mask, differentiable in ``v``.
        softmax_scale: the scale the kernel applied to the scores.

    Returns:
        ``lse`` with the same values, whose gradient flows to ``q`` and ``k``.
    """
    return _LseGrad.apply(lse.detach(), q, k, attend, softmax_scale)


# -- parity cases and benchmark ------------------------------------------------------------


def _attention_cases(dtype: torch.dtype, device: torch.device) -> list[Case]:
    gen = torch.Generator().manual_seed(0)

    def qkv(batch: int, seq_q: int, seq_k: int, heads_q: int, heads_kv: int, dim: int) -> tuple:
        def make(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(device, dtype)

        return make(batch, seq_q, heads_q, dim), make(batch, seq_k, heads_kv, dim), make(batch, seq_k, heads_kv, dim)

    def cu(*bounds: int) -> torch.Tensor:
        return torch.tensor(bounds, dtype=torch.int32, device=device)

    def make_sinks(heads: int) -> torch.Tensor:  # fp32 as GPT-OSS keeps them, near the scores' size
        return (2 * torch.randn(heads, generator=gen)).to(device)

    lse, window, varlen = frozenset({FEATURE_LSE}), frozenset({FEATURE_WINDOW}), frozenset({FEATURE_VARLEN})
    alibi = frozenset({FEATURE_ALIBI})

    def slopes(heads: int) -> torch.Tensor:
        return get_alibi_slopes(heads).to(device)

    alibi_cases = [
        Case("alibi causal 6 heads", qkv(2, 9, 9, 6, 6, 16), {"alibi_slopes": slopes(6)}, features=alibi),
        Case("alibi gqa full", qkv(1, 7, 7, 4, 2, 16), {"causal": False, "alibi_slopes": slopes(4)}, features=alibi),
        Case("alibi decode sq<sk", qkv(1, 3, 8, 3, 3, 16), {"alibi_slopes": slopes(3)}, features=alibi),
        Case(
            "alibi varlen window",
            qkv(1, 12, 12, 5, 5, 16),
            {"window_size": (3, 0), "cu_seqlens": cu(0, 5, 12), "alibi_slopes": slopes(5)},
            features=alibi | window | varlen,
        ),
        Case(
            "alibi lse", qkv(1, 6, 6, 6, 3, 16), {"return_lse": True, "alibi_slopes": slopes(6)}, features=alibi | lse
        ),
    ]
    return [
        *alibi_cases,
        Case("causal", qkv(2, 7, 7, 4, 4, 16)),
        Case("full odd shape", qkv(1, 9, 9, 3, 3, 24), {"causal": False}),
        Case("gqa causal", qkv(2, 11, 11, 6, 2, 16)),
        Case("mqa full", qkv(1, 5, 5, 4, 1, 32), {"causal": False}),
        Case("decode sq<sk causal", qkv(2, 3, 10, 4, 2, 16)),
        Case("sq>sk causal, empty rows", qkv(1, 6, 4, 2, 2, 16)),
        Case("cross sq<sk full", qkv(1, 4, 9, 2, 1, 16), {"causal": False, "softmax_scale": 0.3}),
        Case("sliding window", qkv(1, 13, 13, 2, 2, 16), {"window_size": (3, 0)}, features=window),
        Case("band window", qkv(2, 10, 10, 4, 2, 16), {"causal": False, "window_size": (2, 3)}, features=window),
        Case(
            "window sq>sk, empty rows",
            qkv(1, 8, 5, 2, 2, 16),
            {"causal": False, "window_size": (1, 1)},
            features=window,
        ),
        Case("varlen causal", qkv(1, 13, 13, 4, 2, 16), {"cu_seqlens": cu(0, 3, 8, 13)}, features=varlen),
        Case("varlen full", qkv(1, 9, 9, 2, 2, 16), {"causal": False, "cu_seqlens": cu(0, 4, 4, 9)}, features=varlen),
        Case(
            "varlen window",
            qkv(1, 12, 12, 2, 1, 16),
            {"window_size": (2, 0), "cu_seqlens": cu(0, 7, 12)},
            features=window | varlen,
        ),
        # Unequal lengths, an empty segment and trailing padding as its own segment: the SDPA
        # backend pads these into batches by length.
        Case(
            "varlen gqa unequal", qkv(1, 24, 24, 4, 2, 16), {"cu_seqlens": cu(0, 1, 3, 10, 10, 19, 24)}, features=varlen
        ),
        Case(
            "varlen band unequal",
            qkv(1, 17, 17, 3, 1, 16),
            {"causal": False, "window_size": (1, 2), "softmax_scale": 0.3, "cu_seqlens": cu(0, 9, 11, 17)},
            features=window | varlen,
        ),
        Case("sinks gqa causal", qkv(2, 9, 9, 4, 2, 16), {"sinks": make_sinks(4)}),
        Case(
            "sinks window decode",
            qkv(1, 3, 10, 4, 2, 16),
            {"window_size": (4, 0), "sinks": make_sinks(4)},
            features=window,
        ),
        Case("lse causal", qkv(2, 7, 7, 4, 2, 16), {"return_lse": True}, features=lse),
        Case("lse full", qkv(1, 5, 8, 3, 3, 16), {"causal": False, "return_lse": True}, features=lse),
        Case("lse sq>sk, empty rows", qkv(1, 6, 3, 4, 2, 16), {"return_lse": True}, features=lse),
        Case(
            "lse varlen window",
            qkv(1, 10, 10, 2, 2, 16),
            {"window_size": (3, 0), "cu_seqlens": cu(0, 6, 10), "return_lse": True},
            features=lse | window | varlen,
        ),
    ]


def _attention_bench(dtype: torch.dtype, device: torch.device) -> Case:
    batch, seq, heads, dim = 1, 1024, 8, 64
    q, k, v = (torch.randn(batch, seq, heads, dim, device=device, dtype=dtype) for _ in range(3))
    return Case(f"b{batch} s{seq} n{heads} d{dim} causal", (q, k, v))


register_op(
    OpSpec(
        name="attention",
        reference=attention_reference,
        doc="BSND attention with GQA, bottom-right causal, sliding window, packed sequences, ALiBi and lse",
        cases=_attention_cases,
        bench_case=_attention_bench,
        # Fused kernels (FlashAttention, NPU) round the probabilities to bf16 before the
        # P @ V matmul, one more bf16 rounding than the fp32 reference.
        tolerances={torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2)},
    )
)


#: Fixed cost of one segment-wise SDPA call (gathers, mask, launch, autograd nodes) in
#: multiply-adds; a score element costs ``heads_q * dim``. Forward + backward on one CPU
#: thread (tools/bench/packed_attention.py): ~0.3 ms a call, ~0.75 ns a multiply-add.
_CALL_COST = 1 << 19
#: A dense-mask score element against a segment's own: on the CPU the masked kernel is a
#: little slower per element than ``is_causal`` (it builds and reads the mask).
_DENSE_COST = 1.25


def _segment_groups(bounds: Sequence[int], call_cost: float) -> list[list[int]]:
    """Group the non-empty segments, longest first, into right-padded batches (one call each).

    A segment joins the current group when padding it to the group's longest ``M``
    (``M**2 - L**2`` score elements) costs no more than another call (``call_cost`` elements).
    Returns lists of segment indices.
    """
    lengths = [(end - start, i) for i, (start, end) in enumerate(zip(bounds, bounds[1:])) if end > start]
    groups: list[list[int]] = []
    group_max = 0
    for length, i in sorted(lengths, key=lambda item: (-item[0], item[1])):  # ties keep row order
        if not groups or group_max * group_max - length * length > call_cost:
            groups.append([])
            group_max = length
        groups[-1].append(i)
    return groups


def _segmented_cost(bounds: Sequence[int], groups: list[list[int]], call_cost: float) -> float:
    """Estimated work of the segment-wise path in score elements (``call_cost`` per call)."""
    longest = [max(bounds[i + 1] - bounds[i] for i in group) for group in groups]
    return sum(len(group) * m * m + call_cost for group, m in zip(groups, longest))


@dataclass(frozen=True)
class _SegmentPlan:
    """How :func:`_attention_segmented` runs one packed row: index tensors and per-group masks.

    Attributes:
        index: the row's token of every slot of the groups' padded batches (``seq``: padding).
        inverse: where each token's output lies in the concatenated group outputs.
        in_place: the segments are in row order without padding (no gathers needed).
        padded: some slot reads the appended zero token.
        groups: per group ``(segments, longest, mask, is_causal)``.
    """

    index: torch.Tensor
    inverse: torch.Tensor
    in_place: bool
    padded: bool
    groups: tuple[tuple[int, int, torch.Tensor | None, bool], ...]


def _plan_segments(
    bounds: Sequence[int], groups: list[list[int]], *, causal: bool, window_size: Sequence[int], device: torch.device
) -> _SegmentPlan:
    """The gathers and masks of the segment-wise path (built once per step: see :mod:`~mindspeed.ops.mask_cache`).

    Each group gathers its segments into ``[segments, longest, heads, dim]``, right-padded with
    a zero token. Causal attention needs no mask: a padded key sits after every real query of
    its segment. Otherwise keys are masked by validity, and padded queries see every key so
    that no row is empty (SDPA would give NaN, which the backward spreads to the real keys);
    their outputs are dropped, so they get and give no gradient.
    """
    seq = bounds[-1]
    starts_all = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths_all = torch.tensor(bounds[1:], dtype=torch.long) - starts_all
    # One gather for all groups and one scatter back: every indexing op's backward allocates
    # a zero tensor the size of the whole row, which per group would cost more than the attention.
    valids, indices = [], []
    for group in groups:
        starts, lengths = starts_all[group], lengths_all[group]
        cols = torch.arange(int(lengths.max()))
        valid = cols[None, :] < lengths[:, None]  # [segments, longest]
        indices.append(torch.where(valid, starts[:, None] + cols[None, :], seq).flatten())
        valids.append(valid)
    index = torch.cat(indices)
    real = torch.cat([valid.flatten() for valid in valids])
    # Where each real token's output lands in the concatenation of the groups' outputs.
    inverse = torch.empty(seq, dtype=torch.long)
    inverse[index[real]] = torch.arange(index.numel())[real]
    planned = []
    for valid in valids:
        n, longest = valid.shape
        ragged = not bool(valid.all())
        # A bound as wide as the group's longest segment hides nothing, nor does a right bound
        # under causal; a lone right bound of 0 is causal. Dropping them drops the mask.
        left, right = (-1 if w >= longest - 1 else int(w) for w in window_size)
        is_causal = causal or (left, right) == (-1, 0)
        window = (left, -1 if is_causal else right)
        windowed, valid = window != (-1, -1), valid.to(device)
        if windowed:
            mask = _build_visible(longest, longest, is_causal, window, None, device)
            if ragged:
                mask = ((mask[None] & valid[:, None, :]) | ~valid[:, :, None])[:, None]
        else:
            mask = valid[:, None, None, :] if ragged and not is_causal else None
        planned.append((n, longest, mask, is_causal and not windowed))
    return _SegmentPlan(
        index=index.to(device),
        inverse=inverse.to(device),
        # Segments already in row order without padding (equal lengths, or one) need no gathers.
        in_place=index.numel() == seq and bool((index == torch.arange(seq)).all()),
        padded=not bool(real.all()),
        groups=tuple(planned),
    )


def _attention_segmented(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _SegmentPlan, softmax_scale: float | None
) -> torch.Tensor:
    """Packed attention one padded batch of segments at a time (see :func:`attention_sdpa`)."""
    gqa = q.shape[2] != k.shape[2]
    sources = (q[0], k[0], v[0])
    if plan.padded:  # padding reads a zero token appended at index ``seq``
        sources = tuple(torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in sources)
    sizes = [n * m for n, m, _, _ in plan.groups]
    gathered = [(x if plan.in_place else x.index_select(0, plan.index)).split(sizes) for x in sources]
    pieces = []
    for (n, longest, mask, is_causal), qg, kg, vg in zip(plan.groups, *gathered):
        qg, kg, vg = (x.view(n, longest, *x.shape[1:]).transpose(1, 2) for x in (qg, kg, vg))
        out = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, is_causal=is_causal, scale=softmax_scale, enable_gqa=gqa
        )
        pieces.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # [tokens, heads, dim]
    joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return (joined if plan.in_place else joined.index_select(0, plan.inverse)).unsqueeze(0)


def _packed_plan(
    cu_seqlens: torch.Tensor, width: int, seq: int, *, causal: bool, window_size: Sequence[int], device: torch.device
) -> _SegmentPlan | None:
    """The segment-wise plan of a packed row, or ``None`` where one dense mask is estimated cheaper."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    call_cost = _CALL_COST / width
    groups = _segment_groups(bounds, call_cost)
    if _segmented_cost(bounds, groups, call_cost) >= _DENSE_COST * seq * seq:
        return None
    return _plan_segments(bounds, groups, causal=causal, window_size=window_size, device=device)


@register_kernel("attention", "sdpa", priority=5, features=(FEATURE_WINDOW, FEATURE_VARLEN, FEATURE_ALIBI))
def attention_sdpa(
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
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` (fused kernels where torch has them).

    Same arguments as :func:`attention_reference`, without ``return_lse`` (SDPA does not
    return the log-sum-exp; for the same reason ``sinks`` go to the reference, logged once). Plain causal attention with ``seq_q == seq_k`` uses
    ``is_causal``; windows and bottom-right causal with ``seq_q != seq_k`` pass an explicit
    boolean mask. Packed sequences run segment by segment, batched by similar length, with
    ``is_causal`` (a mask only for windows and padding); a dense block-diagonal mask over the
    whole row costs ``seq ** 2`` and is used only where the estimate says it is cheaper.
    ALiBi (``alibi_slopes``) passes the bias as a float mask (dense, packed sequences included).
    """
    if return_lse:
        raise ValueError("attention impl 'sdpa' cannot return lse; resolve the op with features=('lse',)")
    if sinks is not None:
        kwargs = dict(
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            cu_seqlens=cu_seqlens,
            alibi_slopes=alibi_slopes,
        )
        return attention_with_sinks("sdpa", None, q, k, v, sinks, **kwargs)
    check_attention_inputs(q, k, v, window_size, cu_seqlens, alibi_slopes)
    seq_q, seq_k = q.shape[1], k.shape[1]
    gqa = q.shape[2] != k.shape[2]
    if alibi_slopes is not None:
        return _attention_sdpa_biased(
            q,
            k,
            v,
            alibi_slopes,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            cu_seqlens=cu_seqlens,
        )
    if cu_seqlens is not None:
        window, width = tuple(int(w) for w in window_size), q.shape[2] * q.shape[3]
        plan = shared_mask(
            ("sdpa packed plan", seq_q, width, causal, window, q.device),
            cu_seqlens,
            lambda: _packed_plan(cu_seqlens, width, seq_q, causal=causal, window_size=window, device=q.device),
        )
        if plan is not None:
            return _attention_segmented(q, k, v, plan, softmax_scale)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    plain = cu_seqlens is None and tuple(int(w) for w in window_size) == (-1, -1)
    if plain and (not causal or seq_q == seq_k):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    empty = num_empty_rows(seq_q, seq_k, causal=causal, window_size=window_size)

    def build() -> torch.Tensor:
        mask = _build_visible(seq_q, seq_k, causal, window_size, cu_seqlens, q.device)
        if empty:
            # SDPA gives NaN (forward or backward, depending on the kernel) for rows without keys:
            # let those rows see every key, then zero their output, which also zeroes their gradients.
            mask[:empty] = True
        return mask

    window = tuple(int(w) for w in window_size)
    mask = shared_mask(("sdpa mask", seq_q, seq_k, causal, window, q.device), cu_seqlens, build)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
    out = out.transpose(1, 2)
    if empty:
        rows = torch.arange(seq_q, device=q.device) < empty
        out = out.masked_fill(rows[None, :, None, None], 0)
    return out


def _attention_sdpa_biased(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
    window_size: Sequence[int],
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA with the ALiBi bias as a float ``[heads, seq_q, seq_k]`` mask (-inf where a key is hidden)."""
    seq_q, seq_k = q.shape[1], k.shape[1]
    empty = num_empty_rows(seq_q, seq_k, causal=causal, window_size=window_size)
    window = tuple(int(w) for w in window_size)

    def build() -> torch.Tensor:
        bias = alibi_bias(alibi_slopes, seq_q, seq_k, q.device)
        if causal or window != (-1, -1) or cu_seqlens is not None:
            visible = _build_visible(seq_q, seq_k, causal, window, cu_seqlens, q.device)
            bias = bias.masked_fill(~visible, float("-inf"))
        if empty:  # as in attention_sdpa: rows without keys see every key, then their output is zeroed
            bias[:, :empty] = 0.0
        return bias.to(q.dtype)

    # Every layer of a tensor-parallel rank holds the same slopes tensor (``shard_alibi_slopes``).
    key = ("sdpa alibi", seq_q, seq_k, causal, window, q.dtype, q.device)
    bias = shared_mask(key, (alibi_slopes, cu_seqlens), build)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=bias, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2]
    ).transpose(1, 2)
    if empty:
        rows = torch.arange(seq_q, device=q.device) < empty
        out = out.masked_fill(rows[None, :, None, None], 0)
    return out
