"""Per-token estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

With ``log_r = ref_logp - logp`` (the log-ratio reference / policy at the sampled token),
Schulman's "Approximating KL divergence" (2020) gives three estimators:

- ``k1 = -log_r = logp - ref_logp``: unbiased, high variance, can be negative.
- ``k2 = (log_r)^2 / 2``: biased, low variance, always >= 0.
- ``k3 = exp(log_r) - log_r - 1``: unbiased, low variance, always >= 0 (GRPO's KL term).
- ``low_var_kl``: verl's clamped k3: ``log_r`` clamped to [-20, 20], the estimate to [-10, 10],
  so a wild token (a log-ratio of 99 overflows ``exp`` in fp32) gives a finite value and gradient.

All of them are differentiable in ``logp``; ``ref_logp`` is a constant (the frozen reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mindspeed.registry import Registry

KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: name -> fn(logp, ref_logp) -> per-token KL estimate.
KL_ESTIMATORS: Registry[KlFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``logp - ref_logp``."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``(logp - ref_logp)^2 / 2``."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``exp(ref_logp - logp) - (ref_logp - logp) - 1``."""
    log_r = ref_logp - logp
    # expm1 keeps the small-ratio regime (the common one) accurate: exp(x) - 1 - x.
    return torch.expm1(log_r) - log_r


#: verl's clamps of ``low_var_kl``: the log-ratio, then the estimate.
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """verl's ``low_var_kl``: k3 of the log-ratio clamped to [-20, 20], clamped to [-10, 10]."""
    log_r = (ref_logp - logp).clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    return (torch.expm1(log_r) - log_r).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate by the registered ``estimator``.

    Raises:
        ValueError: an unknown estimator name (listing the known ones).
    """
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)
