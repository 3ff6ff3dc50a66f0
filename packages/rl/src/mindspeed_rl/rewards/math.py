"""The ``math`` rule verifier: the suite's one math-answer grader as a reward.

Extraction and equivalence are :mod:`mindspeed.evaluation.math_answer`'s, the rules
``mindspeed-llm evaluate --task gsm8k`` scores with, so a policy is rewarded by the rules it is
later evaluated by: the last ``\\boxed{}``, else the first ``#### <number>``, else (unless
``strict``) the last number; compared by value as exact fractions.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed.evaluation.math_answer import grade_answer


@dataclass
class MathVerifier:
    """Reward 1 for a final answer equal to the reference's, else 0 (a :class:`RewardFunction`).

    Args:
        strict: only boxed or ``####`` answers count (no last-number fallback).
        correct: the reward of a correct answer.
        incorrect: the reward of a wrong or missing answer (DAPO uses -1).
    """

    strict: bool = False
    correct: float = 1.0
    incorrect: float = 0.0

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """Score ``response`` against ``reference`` (``prompt`` is unused).

        Raises:
            ValueError: if ``reference`` is None (the math verifier needs the answer).
        """
        if reference is None:
            raise ValueError(
                "the math verifier needs a reference answer: set data.map_keys.reference to the answer field"
            )
        return self.correct if grade_answer(response, reference, strict=self.strict) else self.incorrect
