"""Rewards: rule verifiers (math answers, formats), their weighted sum, and a reward model."""

from __future__ import annotations

from mindspeed.evaluation.math_answer import (
    answers_equal,
    extract_answer,
    extract_boxed,
    parse_number,
    reference_answer,
)
from mindspeed_rl.rewards.base import (
    VERIFIERS,
    RewardFunction,
    WeightedReward,
    build_reward,
    build_verifier,
    score_batch,
)
from mindspeed_rl.rewards.format import FORMAT_PRESETS, FormatVerifier
from mindspeed_rl.rewards.math import MathVerifier
from mindspeed_rl.rewards.model import RewardModel
from mindspeed_rl.rewards.turns import TurnFormatVerifier

__all__ = [
    "FORMAT_PRESETS",
    "VERIFIERS",
    "FormatVerifier",
    "MathVerifier",
    "RewardFunction",
    "RewardModel",
    "TurnFormatVerifier",
    "WeightedReward",
    "answers_equal",
    "build_reward",
    "build_verifier",
    "extract_answer",
    "extract_boxed",
    "parse_number",
    "reference_answer",
    "score_batch",
]
