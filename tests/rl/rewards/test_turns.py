"""The per-turn format reward (``turn_format``): its numbers, and how it combines with the answer's reward."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.rewards import TurnFormatVerifier, build_reward, build_verifier

GOOD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'
BAD_JSON = "<tool_call>\n{not json}\n</tool_call>"
NO_NAME = '<tool_call>{"arguments": {"expression": "1"}}</tool_call>'
UNCLOSED = '<tool_call>{"name": "calculator", "arguments": {'


def test_turn_scores() -> None:
    fmt = TurnFormatVerifier(answer="gsm8k")
    assert fmt.score_turns([GOOD, "So #### 12"]) == 1.0
    assert fmt.score_turns([BAD_JSON, "So #### 12"]) == 0.5
    assert fmt.score_turns([GOOD, GOOD, "twelve"]) == pytest.approx(2 / 3)  # the answer misses the format
    assert fmt.score_turns([NO_NAME, UNCLOSED, "#### 12"]) == pytest.approx(1 / 3)
    assert fmt.score_turns([GOOD + "\n" + BAD_JSON, "#### 12"]) == 0.5  # one bad call spoils its turn
    assert fmt.score_turns([UNCLOSED]) == 0.0 and fmt.score_turns([]) == 0.0
    assert fmt("", "#### 7", None) == 1.0 and fmt("", "seven", None) == 0.0  # single turn: the response
    ranged = TurnFormatVerifier(score=1.0, miss=-1.0)  # any non-empty answer
    assert ranged.score_turns([BAD_JSON, "twelve"]) == 0.0
    assert ranged.score_turns([GOOD, "  "]) == 0.0 and ranged.score_turns([GOOD, "x"]) == 1.0
    custom = TurnFormatVerifier(pattern=r"^ANSWER: \d+$")
    assert custom.score_turns([GOOD, "ANSWER: 12"]) == 1.0 and custom.score_turns(["ANSWER: twelve"]) == 0.0


def test_weighted_with_the_answer_reward() -> None:
    reward = build_reward(["math", "turn_format"], [1.0, 0.25], {"turn_format": {"answer": "gsm8k"}})
    responses = ["#### 12", "#### 13", "#### 12"]
    turns = [[GOOD, "#### 12"], [BAD_JSON, "#### 13"], ["#### 12"]]
    total, parts = reward.score_batch(["p"] * 3, responses, ["12"] * 3, turns)
    assert parts["math"].tolist() == [1.0, 0.0, 1.0]
    assert parts["turn_format"].tolist() == [1.0, 0.5, 1.0]
    assert torch.allclose(total, torch.tensor([1.25, 0.125, 1.25]))
    # Without turns (single-turn rollouts) it reads the response as one turn.
    _, parts = reward.score_batch(["p"] * 3, responses, ["12"] * 3)
    assert parts["turn_format"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="turn lists"):
        reward.score_batch(["p"] * 3, responses, ["12"] * 3, turns[:2])


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown format preset 'nope'"):
        build_verifier("turn_format", answer="nope")
    with pytest.raises(ValueError, match="turn_format"):
        build_verifier("turn_format", weight=2)
