"""The coefficient of the KL penalty folded into PPO's per-token reward, fixed or adaptive.

verl's ``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``) and its controllers
(``AdaptiveKLController`` / ``FixedKLController`` in ``verl/trainer/ppo/core_algos.py``, from
Ziegler et al. 2019, arXiv 1909.08593, section 2.2), stated here as formulas:

- the per-token reward is ``score_t - beta * kl_t`` with the coefficient ``beta`` as it stands
  *before* this batch's update, ``kl_t`` the KL estimate of the policy that generated the
  batch to the reference (0 on padding);
- the batch's KL is the mean over responses of each response's mean ``kl_t`` over its tokens;
- then the controller updates with that KL and ``n_steps`` = the number of responses:
  ``fixed`` keeps ``beta``; ``adaptive`` multiplies it by
  ``1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.

Controllers are registered in :data:`KL_CONTROLLERS` (``fn(kl_coef, target_kl, horizon)``) and
carry their coefficient in :meth:`KLController.state_dict` for a resumed run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mindspeed.registry import Registry
from mindspeed_rl.algorithms.functional import masked_mean
from mindspeed_rl.algorithms.reinforce import token_rewards_with_outcome

#: verl's bound on the proportional error of the adaptive controller.
ADAPTIVE_ERROR_CLIP = 0.2


class KLController:
    """A KL coefficient (``value``) and its update rule (fixed: none)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Take one batch's KL into account (the fixed controller ignores it)."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        """The coefficient, for a checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient of :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController(KLController):
    """Ziegler et al.'s proportional controller: ``beta`` moves towards the value that gives ``target_kl``."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(kl_coef)
        if target_kl <= 0 or horizon < 1:
            raise ValueError(
                f"the adaptive KL controller needs target_kl > 0 and horizon >= 1 (got {target_kl}, {horizon})"
            )
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon


KLControllerFn = Callable[[float, float, int], KLController]

#: ``type`` -> controller (verl's ``algorithm.kl_ctrl.type``).
KL_CONTROLLERS: Registry[KLControllerFn] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def fixed_kl_controller(kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """``beta`` stays ``kl_coef`` (``target_kl`` and ``horizon`` are unused)."""
    del target_kl, horizon
    return KLController(kl_coef)


@KL_CONTROLLERS.register("adaptive")
def adaptive_kl_controller(kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """``beta`` starts at ``kl_coef`` and follows :class:`AdaptiveKLController`'s rule."""
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """The registered controller ``kind``.

    Raises:
        ValueError: an unknown kind (listing the known ones) or bad adaptive settings.
    """
    return KL_CONTROLLERS.get(kind)(kl_coef, target_kl, horizon)


@dataclass
class KLPenalty:
    """What :func:`apply_kl_penalty` gives: the per-token rewards and the numbers it logged."""

    token_rewards: torch.Tensor
    kl: float
    kl_coef: float


def apply_kl_penalty(
    rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, controller: KLController
) -> KLPenalty:
    """Fold ``-beta * kl`` into the per-token reward, then update the controller with the batch's KL.

    Args:
        rewards: ``[batch]`` outcome rewards, placed at each response's last counted token.
        kl: ``[batch, len]`` per-token KL estimates (any registered estimator; padding ignored).
        mask: ``[batch, len]``, 1 on response tokens.
        controller: its ``value`` is ``beta`` for this batch; it is updated afterwards.

    Returns:
        The ``[batch, len]`` rewards (0 on padding), the batch's KL (mean over responses of the
        per-response token mean) and the ``beta`` used.
    """
    beta = controller.value
    kl = torch.where(mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    token_rewards = token_rewards_with_outcome(rewards, mask, -beta * kl)
    current_kl = float(masked_mean(kl, mask, dim=-1).mean())
    controller.update(current_kl, n_steps=int(mask.shape[0]))
    return KLPenalty(token_rewards=token_rewards, kl=current_kl, kl_coef=beta)
