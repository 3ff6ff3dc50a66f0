"""The actor's log-prob head on one rank's whole vocabulary: log-probs of the response tokens (and
their entropies, without gradient) from the packed logits in one autograd node.

:func:`~mindspeed_rl.models.actor_parallel.vocab_parallel_logp_entropy` is the general head
(vocab-parallel logits, padding columns, an entropy with gradient) built from autograd's ops: it
first gathers the ``[n, width]`` response rows out of the ``[T, V]`` logits (an index forward and
a zero-filled scatter backward over ``[n * width, V]``), then runs ~6 passes over them forward and
~8 backward. Here, per packed position ``t`` with ``z = logits[t]``::

    e = exp(z - max z),  S = sum_v e_v,  log Z = max z + log S
    log p(y_i) = z[t_i, y_i] - log Z[t_i]            (the response token i read at its position t_i)
    H[t] = log Z - (sum_v e_v z_v) / S               (no gradient)
    d/dz[t] = -(G[t] / S[t]) e + sum_{i: t_i = t} g_i onehot(y_i),   G[t] = sum_{i: t_i = t} g_i

so the forward makes 4 passes over ``[T, V]`` (max, exp, sum, the entropy's dot) and the backward 1
(plus a scatter of the ``n * width`` token gradients), with no ``[n * width, V]`` copy: a shared
prompt's last position, which predicts the first token of every response of its group, is one row.
It applies where the rank holds the whole vocabulary without padding columns and the entropy
needs no gradient (no entropy bonus); the actor uses the general head elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch


class _LogpHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.float()
        m = z.amax(-1, keepdim=True)
        e = torch.sub(z, m).exp_()
        total = e.sum(-1)
        log_z = m.squeeze(-1) + total.log()
        logp = z[index, targets] - log_z[index]
        if entropy:
            ent = (log_z - torch.linalg.vecdot(e, z) / total)[index]
        else:
            ent = logp.new_zeros(())
        ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(e, total, index, targets)
        ctx.dtype = logits.dtype
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: Any) -> tuple[Any, ...]:  # type: ignore[override]
        e, total, index, targets = ctx.saved_tensors
        per_position = torch.zeros_like(total).index_add_(0, index, grad_logp)
        grad = e * (per_position / total).neg_().unsqueeze(-1)
        grad.index_put_((index, targets), grad_logp, accumulate=True)
        return grad.to(ctx.dtype), None, None, None


def packed_logp_entropy(
    logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (differentiable) and entropies (no gradient) of the response tokens.

    Args:
        logits: ``[..., V]`` the packed positions' logits over the whole vocabulary (any float dtype;
            no padding columns).
        index: ``[n, width]`` the packed position that predicts each response token.
        targets: ``[n, width]`` the token it predicts (any value where masked later; clamped here).
        entropy: also return the entropy at each response token's position (else None).

    Returns:
        float32 ``(logp, entropy)`` shaped like ``index``.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    rows, tokens = index.reshape(-1), targets.reshape(-1).clamp(0, flat.shape[-1] - 1)
    logp, ent = _LogpHead.apply(flat, rows, tokens, entropy)
    return logp.view_as(index), ent.view_as(index) if entropy else None
