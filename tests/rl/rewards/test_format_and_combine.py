"""The format verifier, the verifier registry and the weighted combination of rewards."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.rewards import VERIFIERS, FormatVerifier, RewardFunction, build_reward, build_verifier, score_batch


@pytest.mark.parametrize(
    "preset, response, ok",
    [
        ("boxed", r"so \boxed{4}", True),
        ("boxed", "so 4", False),
        ("gsm8k", "2 + 2 = 4\n#### 4", True),
        ("gsm8k", "#### 4\nthen more text", False),
        ("gsm8k", "#### 1,234", True),
        ("think", "<think>2 + 2 is 4</think> The answer is 4.", True),
        ("think", "<think>\nmulti\nline\n</think>\n4", True),
        ("think", "<think>no answer after</think>   ", False),
        ("think", "4 <think>late</think> 4", False),
        ("think", "<think>a</think><think>b</think> 4", False),
        ("think", "<think>unclosed 4", False),
        ("think_boxed", r"<think>x</think> \boxed{4}", True),
        ("think_boxed", "<think>x</think> 4", False),
    ],
)
def test_presets(preset: str, response: str, ok: bool) -> None:
    assert FormatVerifier(preset=preset)("p", response, None) == (1.0 if ok else 0.0)


def test_custom_pattern_and_errors() -> None:
    answer_tag = FormatVerifier(pattern=r"<answer>\s*-?\d+\s*</answer>", score=0.5, miss=-0.5)
    assert answer_tag("p", "blah <answer> 12 </answer>", None) == 0.5
    assert answer_tag("p", "<answer>twelve</answer>", None) == -0.5
    whole = FormatVerifier(pattern=r"\d+", fullmatch=True)
    assert whole("p", "123", None) == 1.0 and whole("p", "123 apples", None) == 0.0
    with pytest.raises(ValueError, match="unknown format preset 'boxd'"):
        FormatVerifier(preset="boxd")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        FormatVerifier(pattern="(")


def test_registry_and_weighted_sum() -> None:
    assert {"math", "format"} <= set(VERIFIERS.keys())
    assert isinstance(build_verifier("math"), RewardFunction)
    reward = build_reward(["math", "format"], weights=[1.0, 0.2], options={"format": {"preset": "boxed"}})
    prompts = ["What is 2 + 2?"] * 3
    responses = [r"\boxed{4}", "4", r"\boxed{5}"]
    total, parts = reward.score_batch(prompts, responses, ["#### 4"] * 3)
    assert parts["math"].tolist() == [1.0, 1.0, 0.0] and parts["format"].tolist() == [1.0, 0.0, 1.0]
    torch.testing.assert_close(total, torch.tensor([1.2, 1.0, 0.2]))
    assert score_batch(build_verifier("format"), prompts, responses) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        build_reward(["math"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="Did you mean 'math'"):
        build_reward(["maths"])
    with pytest.raises(ValueError, match="reward verifier 'math'"):
        build_verifier("math", tolerance=0.1)
    with pytest.raises(ValueError, match="not in the verifier list"):
        build_reward(["math"], options={"format": {}})
    with pytest.raises(ValueError, match="one of each"):
        score_batch(build_verifier("format"), ["p"], ["a", "b"])
