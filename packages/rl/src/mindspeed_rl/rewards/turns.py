"""The ``turn_format`` verifier: a per-turn format reward of a multi-turn, tool-using response.

Each assistant turn is scored on its own, then the scores are averaged: a turn with tool calls
is well-formed when every ``<tool_call>`` block in it parses strictly
(:func:`mindspeed_rl.tools.parse_tool_calls`: closed, one JSON object with ``name`` and
``arguments``); a turn without calls is the answer and is well-formed when it matches the answer
format (a :data:`~mindspeed_rl.rewards.format.FORMAT_PRESETS` key or a regular expression; none:
any non-empty text). The reward of a response is ``miss + (score - miss) * well_formed / turns``,
so a response of ``k`` turns moves by ``(score - miss) / k`` per malformed turn. It enters the
total like any verifier, with its weight (``reward.weights``). The trainer hands it the turns
(:meth:`TurnFormatVerifier.score_turns`); called as a plain verifier it scores the response as
one turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mindspeed_rl.rewards.format import FormatVerifier
from mindspeed_rl.tools import parse_tool_calls


@dataclass
class TurnFormatVerifier:
    """Mean per-turn format score of a multi-turn response (see the module docstring).

    Args:
        answer: the answer turn's format: a preset of :data:`FORMAT_PRESETS` (``gsm8k``, ``boxed``,
            ...) or None (any non-empty text).
        pattern: a custom regular expression for the answer turn instead (DOTALL, searched).
        score: reward of an all-well-formed response.
        miss: reward of a response without one well-formed turn.

    Raises:
        ValueError: an unknown preset or a pattern that does not compile.
    """

    answer: str | None = None
    pattern: str | None = None
    score: float = 1.0
    miss: float = 0.0
    _answer: FormatVerifier | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.pattern is not None:
            self._answer = FormatVerifier(pattern=self.pattern)
        elif self.answer is not None:
            self._answer = FormatVerifier(preset=self.answer)

    def turn_ok(self, text: str) -> bool:
        """Whether one assistant turn is well-formed."""
        calls = parse_tool_calls(text)
        if calls:
            return all(call.error is None for call in calls)
        if self._answer is None:
            return bool(text.strip())
        return self._answer("", text, None) == self._answer.score

    def score_turns(self, turns: Sequence[str]) -> float:
        """The reward of a response made of these assistant turns (``miss`` for none)."""
        if not turns:
            return self.miss
        good = sum(self.turn_ok(t) for t in turns)
        return self.miss + (self.score - self.miss) * good / len(turns)

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """A single-turn response: scored as one turn (``prompt`` and ``reference`` are unused)."""
        return self.score_turns([response])
