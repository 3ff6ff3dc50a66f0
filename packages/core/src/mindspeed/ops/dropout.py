"""Dropout for a small drop probability on the host: draw only the dropped positions.

``torch.dropout`` on a CPU tensor draws one Bernoulli number per element: on CPUs where torch
does not use MKL's vectorised generator (AMD among them) that is a serial Mersenne-Twister draw,
about 5.5 ns per element, 50 times the cost of the multiply that applies the mask. LoRA drops
5 % of the adapted linears' inputs, so :func:`sparse_dropout` draws the gaps between dropped
elements instead (geometric, ``floor(log(1 - u) / log(1 - p))`` for uniform ``u``: exactly
i.i.d. Bernoulli(``p``) drops, ``p`` not rounded), about ``p * n`` draws for ``n`` elements,
and saves only their positions for the backward (8 bytes per dropped element instead of a
4-byte mask per element). The masks come from the same generator ``torch.dropout`` would use
(the default one of the device, or megatron's forked tensor-parallel stream inside its
``fork()``), so which ranks share a mask is unchanged; the draws themselves differ from
``torch.dropout``'s (the same distribution, other numbers).
"""

from __future__ import annotations

import math

import torch

#: Above this drop probability the gap draws save little over one draw per element.
MAX_SPARSE_P = 0.5


def dropped_positions(numel: int, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat indices of the elements a dropout of probability ``p`` drops (each independently).

    Args:
        numel: the number of elements.
        p: the drop probability, in ``(0, 1)``.
        device: where the generator and the result live.

    Returns:
        Sorted ``int64`` positions in ``[0, numel)``.
    """
    log_keep, found, start = math.log1p(-p), [], 0
    while start < numel:
        left = numel - start
        count = int(left * p + 6.0 * math.sqrt(left * p) + 16)  # enough gaps to pass the end, almost always
        u = torch.rand(count, dtype=torch.float64, device=device)
        # Failures before the next drop: floor(log(1 - u) / log(1 - p)); 1 - u is in (0, 1].
        gaps = torch.floor(torch.log1p(-u) / log_keep).to(torch.int64) + 1
        positions = torch.cumsum(gaps, 0).add_(start - 1)
        found.append(positions[positions < numel])
        start = int(positions[-1]) + 1
    if len(found) == 1:
        return found[0]
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=device)


class _SparseDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
        out = x.mul(scale)
        out.view(-1).index_fill_(0, positions, 0.0)
        ctx.save_for_backward(positions)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (positions,) = ctx.saved_tensors
        out = grad.mul(ctx.scale).contiguous()
        out.view(-1).index_fill_(0, positions, 0.0)
        return out, None, None


def sparse_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with the drops drawn by :func:`dropped_positions`.

    Falls back to ``F.dropout`` where that is as cheap (not a CPU tensor, ``p`` above
    :data:`MAX_SPARSE_P`); ``p == 0`` or ``training=False`` return ``x``.
    """
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or not 0.0 < p <= MAX_SPARSE_P:
        return torch.nn.functional.dropout(x, p, training=True)
    x = x.contiguous()
    return _SparseDropout.apply(x, dropped_positions(x.numel(), p, x.device), 1.0 / (1.0 - p))
