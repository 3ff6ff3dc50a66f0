"""RL algorithms as registries: advantage estimators (outcome, token-level, critic-based), KL estimators and
controllers, policy and value losses, shaping."""

from __future__ import annotations

from mindspeed_rl.algorithms.advantages import ADVANTAGES, broadcast_to_tokens, compute_advantages
from mindspeed_rl.algorithms.functional import (
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
)
from mindspeed_rl.algorithms.gae import VALUE_ADVANTAGES, compute_value_advantages, gae_advantages
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from mindspeed_rl.algorithms.kl_control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    KLController,
    KLPenalty,
    apply_kl_penalty,
    build_kl_controller,
)
from mindspeed_rl.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInputs,
    PolicyLossOutput,
    compute_policy_loss,
    policy_loss_config,
)
from mindspeed_rl.algorithms.reinforce import (
    TOKEN_ADVANTAGES,
    compute_token_advantages,
    discounted_returns,
    masked_whiten,
)
from mindspeed_rl.algorithms.shaping import (
    DynamicSampler,
    constant_groups,
    overlong_penalty,
    truncated_importance_weights,
)
from mindspeed_rl.algorithms.value_loss import (
    VALUE_LOSSES,
    ValueLossInputs,
    ValueLossOutput,
    compute_value_loss,
    explained_variance,
)

__all__ = [
    "ADVANTAGES",
    "KL_CONTROLLERS",
    "VALUE_ADVANTAGES",
    "VALUE_LOSSES",
    "AdaptiveKLController",
    "KLController",
    "KLPenalty",
    "ValueLossInputs",
    "ValueLossOutput",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_value_advantages",
    "compute_value_loss",
    "explained_variance",
    "gae_advantages",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "DynamicSampler",
    "TOKEN_ADVANTAGES",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "aggregate_loss",
    "broadcast_to_tokens",
    "compute_advantages",
    "compute_policy_loss",
    "compute_token_advantages",
    "discounted_returns",
    "masked_whiten",
    "constant_groups",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "overlong_penalty",
    "policy_loss_config",
    "truncated_importance_weights",
]
