"""The ``math`` verifier: the shared grader (tests/core/evaluation/test_math_answer.py) as a reward."""

from __future__ import annotations

import pytest

from mindspeed_rl.rewards import MathVerifier
from tests.core.evaluation.test_math_answer import GRADES


@pytest.mark.parametrize("response, reference, right", GRADES)
def test_reward_agrees_with_the_grader(response: str, reference: str, right: bool) -> None:
    assert MathVerifier(incorrect=-1.0)("q", response, reference) == (1.0 if right else -1.0)


def test_math_verifier_scores() -> None:
    verifier = MathVerifier()
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert verifier("q", r"She sold \boxed{72} clips.", gsm8k) == 1.0
    assert verifier("q", "48 + 24 = 72", gsm8k) == 1.0
    assert verifier("q", "48 + 24 = 72.0", "72") == 1.0
    assert verifier("q", "I think 71", gsm8k) == 0.0
    assert verifier("q", "no idea", gsm8k) == 0.0
    assert MathVerifier(strict=True)("q", "48 + 24 = 72", gsm8k) == 0.0
    assert MathVerifier(incorrect=-1.0)("q", "70", gsm8k) == -1.0
    with pytest.raises(ValueError, match="reference"):
        verifier("q", "72", None)
