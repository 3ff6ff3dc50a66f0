"""Reward functions: the protocol, the verifier registry, and a weighted sum over a batch.

A reward function maps ``(prompt, response, reference)`` to a float. Rule verifiers are
registered in :data:`VERIFIERS` by name as factories (``VERIFIERS.get("math")(strict=True)``);
:class:`WeightedReward` combines several with weights (MindSpeed-RL's ``verifier_function`` /
``verifier_weight``) and keeps each one's scores for the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from mindspeed.registry import Registry
from mindspeed_rl.rewards.exact import ExactVerifier
from mindspeed_rl.rewards.format import FormatVerifier
from mindspeed_rl.rewards.math import MathVerifier
from mindspeed_rl.rewards.turns import TurnFormatVerifier


@runtime_checkable
class RewardFunction(Protocol):
    """Anything that scores one response: ``fn(prompt, response, reference) -> float``."""

    def __call__(self, prompt: str, response: str, reference: str | None) -> float: ...


#: name -> factory(**options) -> RewardFunction.
VERIFIERS: Registry[Callable[..., RewardFunction]] = Registry("reward verifier")
VERIFIERS.register("math", MathVerifier)
VERIFIERS.register("format", FormatVerifier)
VERIFIERS.register("exact", ExactVerifier)
VERIFIERS.register("turn_format", TurnFormatVerifier)


def build_verifier(name: str, **options: Any) -> RewardFunction:
    """The verifier ``name`` built with ``options``.

    Raises:
        ValueError: unknown verifier (listing the known ones) or an option it does not take.
    """
    factory = VERIFIERS.get(name)
    try:
        return factory(**options)
    except TypeError as err:
        raise ValueError(f"reward verifier {name!r}: {err}") from err


def score_batch(
    fn: RewardFunction,
    prompts: Sequence[str],
    responses: Sequence[str],
    references: Sequence[str | None] | None = None,
    turns: Sequence[Sequence[str]] | None = None,
) -> list[float]:
    """``fn`` over a batch; ``references`` default to None for every row.

    ``turns`` (multi-turn rollouts: each row's assistant turns) go to the functions that score
    turns (``fn.score_turns(turns)``, e.g. ``turn_format``); the others read ``responses``.

    Raises:
        ValueError: if the sequences have different lengths.
    """
    references = [None] * len(responses) if references is None else references
    if not len(prompts) == len(responses) == len(references):
        raise ValueError(
            f"{len(prompts)} prompts, {len(responses)} responses and {len(references)} references: "
            "give one of each per sample"
        )
    per_turn = getattr(fn, "score_turns", None)
    if turns is not None and callable(per_turn):
        if len(turns) != len(responses):
            raise ValueError(f"{len(turns)} turn lists for {len(responses)} responses: give one per sample")
        return [float(per_turn(t)) for t in turns]
    batched = getattr(fn, "score_batch", None)
    if callable(batched):  # a reward model scores a whole batch in one forward
        return [float(v) for v in batched(prompts, responses, references)]
    return [float(fn(p, r, ref)) for p, r, ref in zip(prompts, responses, references)]


@dataclass
class WeightedReward:
    """``sum_i weight_i * fn_i``: several reward functions combined.

    Args:
        functions: name -> reward function.
        weights: name -> weight (default 1 for each).
    """

    functions: Mapping[str, RewardFunction]
    weights: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not self.functions:
            raise ValueError("no reward functions: set reward.verifiers (e.g. [math]) or reward.model")
        unknown = sorted(set(self.weights or {}) - set(self.functions))
        if unknown:
            raise ValueError(
                f"reward weights for {', '.join(unknown)}, which are not among the reward functions "
                f"{', '.join(self.functions)}"
            )

    def score_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
        turns: Sequence[Sequence[str]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total rewards ``[batch]`` (float32) and each function's own scores by name (``turns``:
        each row's assistant turns, for the per-turn functions, see :func:`score_batch`)."""
        parts = {
            name: torch.tensor(score_batch(fn, prompts, responses, references, turns), dtype=torch.float32)
            for name, fn in self.functions.items()
        }
        weights = self.weights or {}
        total = torch.zeros(len(responses), dtype=torch.float32)
        for name, scores in parts.items():
            total += weights.get(name, 1.0) * scores
        return total, parts


def build_reward(
    verifiers: Sequence[str],
    weights: Sequence[float] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    extra: Mapping[str, RewardFunction] | None = None,
) -> WeightedReward:
    """A :class:`WeightedReward` of the registered ``verifiers`` (plus ``extra`` functions, e.g. a reward model).

    Args:
        verifiers: names in :data:`VERIFIERS`.
        weights: one per verifier, then one per ``extra`` function (default all 1).
        options: name -> keyword options of that verifier.
        extra: further named reward functions.

    Raises:
        ValueError: unknown names, bad options, or a wrong number of weights.
    """
    options = options or {}
    unknown = sorted(set(options) - set(verifiers))
    if unknown:
        raise ValueError(f"options for {', '.join(unknown)}, which is not in the verifier list {list(verifiers)}")
    functions: dict[str, RewardFunction] = {name: build_verifier(name, **options.get(name, {})) for name in verifiers}
    functions.update(extra or {})
    if weights is not None and len(weights) != len(functions):
        raise ValueError(
            f"{len(weights)} reward weights for {len(functions)} reward functions ({', '.join(functions)}); "
            "give one weight each"
        )
    return WeightedReward(functions, dict(zip(functions, weights)) if weights is not None else None)
