"""The ``format`` rule verifier: does the response have the required shape (a regex check)?"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: name -> (pattern, whole response must match). Patterns run with DOTALL.
FORMAT_PRESETS: dict[str, tuple[str, bool]] = {
    # a \boxed{...} anywhere
    "boxed": (r"\\boxed\s*\{.*\}", False),
    # GSM8K style: a "#### <number>" line at the end
    "gsm8k": (r".*####\s*[-+]?[\d,]*\.?\d+\s*", True),
    # R1 style: one <think>...</think> block first, then a non-empty answer
    "think": (r"\s*<think>(?:(?!</?think>).)*</think>(?=.*\S)(?:(?!</?think>).)*", True),
    # R1 style whose answer is boxed
    "think_boxed": (
        r"\s*<think>(?:(?!</?think>).)*</think>(?:(?!</?think>).)*\\boxed\s*\{(?:(?!</?think>).)*\}"
        r"(?:(?!</?think>).)*",
        True,
    ),
}


@dataclass
class FormatVerifier:
    """Reward ``score`` when the response matches the format, else ``miss`` (a :class:`RewardFunction`).

    Args:
        preset: a key of :data:`FORMAT_PRESETS` (used when ``pattern`` is None).
        pattern: a custom regular expression (DOTALL).
        fullmatch: with ``pattern``: the whole response must match (else: found anywhere).
        score: reward of a well-formed response.
        miss: reward of any other response.

    Raises:
        ValueError: an unknown preset or a pattern that does not compile.
    """

    preset: str = "boxed"
    pattern: str | None = None
    fullmatch: bool = False
    score: float = 1.0
    miss: float = 0.0
    _regex: re.Pattern[str] = field(init=False, repr=False)
    _whole: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pattern is None:
            if self.preset not in FORMAT_PRESETS:
                raise ValueError(
                    f"unknown format preset {self.preset!r}; use one of {', '.join(FORMAT_PRESETS)} or give a pattern"
                )
            source, self._whole = FORMAT_PRESETS[self.preset]
        else:
            source, self._whole = self.pattern, self.fullmatch
        try:
            self._regex = re.compile(source, re.DOTALL)
        except re.error as err:
            raise ValueError(f"format pattern {source!r} is not a valid regular expression: {err}") from err

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """Score the shape of ``response`` (``prompt`` and ``reference`` are unused)."""
        matched = self._regex.fullmatch(response) if self._whole else self._regex.search(response)
        return self.score if matched else self.miss
