"""The critic's loss and the metrics verl users look for.

``clipped`` is verl's ``compute_value_loss`` (``verl/trainer/ppo/core_algos.py``) and OpenRLHF's
``ValueLoss`` with ``clip_eps``: with ``v`` the critic's new predictions, ``v_old`` its values
when the batch was scored and ``G`` the returns (GAE's ``A + v_old``)::

    v_clip = v_old + clip(v - v_old, -cliprange_value, cliprange_value)
    loss   = 0.5 * agg(max((v - G)^2, (v_clip - G)^2))      agg: token-mean by default, masked
    vf_clipfrac = masked mean of [(v_clip - G)^2 > (v - G)^2]

``mse`` is the unclipped ``0.5 * agg((v - G)^2)``. Both are registered in :data:`VALUE_LOSSES`.
Padding may hold anything: it is selected away (:func:`~mindspeed_rl.algorithms.functional.masked_sum`).

:func:`explained_variance` is verl's ``critic/vf_explained_var``: ``1 - var(G - v_old) /
(var(G) + 1e-5)`` over the response tokens, ``var`` with Bessel's correction (torch's default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mindspeed.registry import Registry
from mindspeed_rl.algorithms.functional import LOSS_AGG_MODES, aggregate_loss, masked_mean

#: verl's guard in the explained variance's denominator.
EXPLAINED_VAR_EPS = 1e-5


@dataclass
class ValueLossInputs:
    """``[batch, len]`` tensors of one (micro-)batch.

    Attributes:
        vpreds: the critic's predictions now (differentiable).
        values: its predictions when the batch was scored (the clipping centre).
        returns: the regression targets.
        mask: 1 on response tokens.
        num_tokens: ``token-mean``'s denominator for the whole global batch (micro-batches add
            up to its loss); default this batch's token count.
    """

    vpreds: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    num_tokens: float | torch.Tensor | None = None


@dataclass
class ValueLossOutput:
    """The scalar loss and detached metrics (``vf_loss``, ``vf_clipfrac``, ``vpred_mean``)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


ValueLossFn = Callable[[ValueLossInputs, float, str], ValueLossOutput]

#: name -> critic loss (``critic.value_loss``).
VALUE_LOSSES: Registry[ValueLossFn] = Registry("value loss")


def _check(inputs: ValueLossInputs, loss_agg_mode: str) -> None:
    shape = inputs.mask.shape
    if any(t.shape != shape for t in (inputs.vpreds, inputs.values, inputs.returns)):
        raise ValueError(
            f"vpreds {tuple(inputs.vpreds.shape)}, values {tuple(inputs.values.shape)}, returns "
            f"{tuple(inputs.returns.shape)} and mask {tuple(shape)} must have the same shape"
        )
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")


def _select(inputs: ValueLossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``vpreds``, ``values``, ``returns`` with 0 on padding, selected before any arithmetic: an inf
    there would otherwise give NaN gradients (0 * inf) through the square even where the loss masks it."""
    keep = inputs.mask.bool()
    zero = torch.zeros((), dtype=inputs.vpreds.dtype, device=inputs.vpreds.device)
    return tuple(torch.where(keep, t, zero) for t in (inputs.vpreds, inputs.values, inputs.returns))


def _output(losses: torch.Tensor, clipped: torch.Tensor, inputs: ValueLossInputs, mode: str) -> ValueLossOutput:
    loss = 0.5 * aggregate_loss(losses, inputs.mask, mode, num_tokens=inputs.num_tokens)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(loss.detach()),
            "vf_clipfrac": float(masked_mean(clipped.to(losses.dtype), inputs.mask)),
            "vpred_mean": float(masked_mean(inputs.vpreds.detach(), inputs.mask)),
        }
    return ValueLossOutput(loss=loss, metrics=metrics)


@VALUE_LOSSES.register("clipped")
def clipped_value_loss(inputs: ValueLossInputs, cliprange_value: float, loss_agg_mode: str) -> ValueLossOutput:
    """verl / OpenRLHF's clipped value loss (see the module docstring)."""
    _check(inputs, loss_agg_mode)
    vpreds, values, returns = _select(inputs)
    vclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq = (vpreds - returns).square()
    clipped_sq = (vclipped - returns).square()
    return _output(torch.maximum(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq, inputs, loss_agg_mode)


@VALUE_LOSSES.register("mse")
def mse_value_loss(inputs: ValueLossInputs, cliprange_value: float, loss_agg_mode: str) -> ValueLossOutput:
    """``0.5 * agg((v - G)^2)`` (``cliprange_value`` unused; ``vf_clipfrac`` is 0)."""
    del cliprange_value
    _check(inputs, loss_agg_mode)
    vpreds, _, returns = _select(inputs)
    losses = (vpreds - returns).square()
    return _output(losses, torch.zeros_like(inputs.mask, dtype=torch.bool), inputs, loss_agg_mode)


def compute_value_loss(
    name: str, inputs: ValueLossInputs, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean"
) -> ValueLossOutput:
    """The registered critic loss ``name``.

    Raises:
        ValueError: unknown loss or aggregation mode (listing the known ones), mismatched shapes.
    """
    return VALUE_LOSSES.get(name)(inputs, cliprange_value, loss_agg_mode)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``critic/vf_explained_var``: ``1 - var(G - v) / (var(G) + 1e-5)`` over the masked tokens."""
    keep = mask.bool()
    picked_returns, picked_values = returns[keep], values[keep]
    if picked_returns.numel() < 2:
        return 0.0
    residual_var = torch.var(picked_returns - picked_values)
    return float(1.0 - residual_var / (torch.var(picked_returns) + EXPLAINED_VAR_EPS))
