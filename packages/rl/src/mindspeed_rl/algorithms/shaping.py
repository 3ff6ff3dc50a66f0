"""Reward shaping and batch selection around the loss: DAPO's overlong punishment and
dynamic sampling, and the truncated importance weights of off-policy samples.

References: DAPO (Yu et al. 2025, arXiv 2503.14476) section 3.4 (soft overlong punishment) and
3.2 (dynamic sampling); truncated importance sampling as in verl's ``tis_imp_ratio_cap``
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mindspeed_rl.algorithms.advantages import group_view


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, one value (<= 0) per response.

    ``0`` up to ``max_length - buffer`` tokens, then a linear ramp down to ``-factor`` at
    ``max_length`` (and ``-factor`` beyond)::

        R(len) = 0                                       len <= L - B
                 ((L - B) - len) / B * factor            L - B < len <= L
                 -factor                                 len > L

    Args:
        lengths: response lengths in tokens, ``[batch]``.
        max_length: ``L``, the rollout's maximum response length.
        buffer: ``B``, the punished window before it (``0 < B <= L``).
        factor: the penalty at ``L``.

    Returns:
        ``[batch]`` float penalties to add to the rewards.

    Raises:
        ValueError: on a buffer outside ``(0, max_length]``.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer {buffer} must be in (0, max length {max_length}]")
    expected = max_length - buffer
    exceed = lengths.to(torch.float32) - expected
    return (-exceed / buffer * factor).clamp(min=-factor, max=0.0)


def constant_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_prompts]`` bool: the groups whose rewards are all equal (no GRPO signal)."""
    groups = group_view(rewards, group_size)
    return groups.amax(-1) == groups.amin(-1)


@dataclass
class DynamicSampler:
    """DAPO's dynamic sampling: keep generating until ``target_groups`` groups with distinct rewards.

    Each round's rewards go to :meth:`add`; groups whose rewards are all equal are dropped (they
    have zero advantage, so they would only dilute the batch). When enough groups are kept,
    :meth:`selection` names them (in arrival order, truncated to ``target_groups``).

    Args:
        target_groups: prompts per training batch (``train.global_batch``).
        group_size: samples per prompt.
        max_rounds: give up after this many generation rounds (DAPO's
            ``max_num_gen_batches``; None: no limit).
    """

    target_groups: int
    group_size: int
    max_rounds: int | None = None
    rounds: int = 0
    num_dropped: int = 0
    num_seen: int = 0
    _kept: list[tuple[int, int]] = field(default_factory=list)

    def add(self, rewards: torch.Tensor) -> list[int]:
        """Take one round's rewards ``[num_groups * group_size]``; returns the kept group indices of this round.

        Raises:
            RuntimeError: if ``max_rounds`` rounds did not yield ``target_groups`` groups.
        """
        if self.done:
            return []
        constant = constant_groups(rewards, self.group_size)
        kept = [i for i, flat in enumerate(constant.tolist()) if not flat]
        self._kept.extend((self.rounds, i) for i in kept)
        self.rounds += 1
        self.num_seen += len(constant)
        self.num_dropped += len(constant) - len(kept)
        if not self.done and self.max_rounds is not None and self.rounds >= self.max_rounds:
            raise RuntimeError(
                f"dynamic sampling: {len(self._kept)} of {self.target_groups} groups with distinct rewards after "
                f"{self.rounds} rounds ({self.num_dropped} of {self.num_seen} groups had all-equal rewards); raise "
                "algorithm.dynamic_sampling_max_rounds, or use easier/harder prompts"
            )
        return kept

    @property
    def done(self) -> bool:
        """Whether enough groups were kept."""
        return len(self._kept) >= self.target_groups

    def selection(self) -> list[tuple[int, int]]:
        """``(round, group)`` pairs of the kept groups, the first ``target_groups`` of them."""
        return self._kept[: self.target_groups]

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/{rounds,dropped_groups,dropped_fraction}``."""
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/dropped_groups": float(self.num_dropped),
            "dynamic_sampling/dropped_fraction": self.num_dropped / max(self.num_seen, 1),
        }


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token ``min(exp(old_logp - rollout_logp), cap)`` (no gradient).

    ``rollout_logp`` are the behaviour policy's log-probs (what the rollout engine sampled with:
    an older policy version in asynchronous mode, or the same weights computed by a different
    kernel); ``old_logp`` the trainer's recomputation under the policy the update starts from.
    Truncating at ``cap`` bounds the variance the correction adds.
    """
    if cap < 1:
        raise ValueError(f"importance weight cap {cap} must be at least 1")
    return torch.exp((old_logp - rollout_logp).detach()).clamp(max=cap)
