"""GSM8K: answer extraction, file checks, and greedy generation scored like an independent loop."""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed.evaluation.math_answer import extract_answer, parse_number, reference_answer
from mindspeed_llm.evaluation import EvalSettings, TransformersLM
from mindspeed_llm.evaluation.gsm8k import STOP, GSM8KTask, build_prompt, read_gsm8k
from tests.core.evaluation.test_math_answer import GRADES

from .conftest import write_gsm8k


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,234.50.", 1234.5),
        ("so she has 5 apples.\n#### 1,000\nthen 7", 1000.0),
        ("#### -7", -7.0),
        ("the change is 3-4 = -1 degrees", -1.0),  # a dash between numbers is no minus sign
        ("it costs $1,000,000 in total", 1_000_000.0),
        ("0.5 and then .25", 0.25),
        ("5 #### 6 and later 7", 6.0),
        ("#### 5 ... #### 7", 5.0),  # the first #### answer, as lm-evaluation-harness' strict-match
        (r"\boxed{12} ... 13", 12.0),  # a box wins, as the RL reward
        ("#### 1/2", 0.5),  # the fraction, not its numerator
        ("no number at all", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected) -> None:
    """The prediction evaluate reports, as a value (the rules themselves: test_math_answer.py)."""
    answer = extract_answer(text)
    assert (None if answer is None else float(parse_number(answer))) == expected


def test_reference_answers_and_bad_records(tmp_path) -> None:
    write_gsm8k(tmp_path, n_test=3)
    problems = read_gsm8k(tmp_path / "test.jsonl")
    for problem in problems:  # the thousands comma is dropped
        a, b = (int(w) for w in problem.question.split() if w.isdigit())
        assert problem.target == a + b
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "4"}) + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the answer must end with '#### <number>'"):
        read_gsm8k(bad)
    bad.write_text(json.dumps({"question": "q", "answer": "#### 4"}) + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected string fields 'question' and 'answer'"):
        read_gsm8k(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        read_gsm8k(bad)


def test_few_shot_prompt(tmp_path) -> None:
    data = GSM8KTask().load(write_gsm8k(tmp_path, n_test=2, n_train=2), EvalSettings(shots=2))
    first, second = data.examples
    expected = (
        f"Question: {first.question}\nAnswer: {first.answer}\n\n"
        f"Question: {second.question}\nAnswer: {second.answer}\n\n"
        f"Question: {data.problems[0].question}\nAnswer:"
    )
    assert build_prompt(data.examples, data.problems[0]) == expected
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ValueError, match="train.jsonl.*--shots 0"):
        GSM8KTask().load(tmp_path, EvalSettings(shots=2))


class _EchoLM:
    """Answers every even problem right (after '####') and every odd one wrong."""

    tokenizer = None
    max_seq_len = 1024

    def __init__(self, targets: list[float]) -> None:
        self.targets, self.calls = targets, 0

    def generate(self, prompts, max_new_tokens, stop):
        out = []
        for _ in prompts:
            k, self.calls = self.calls, self.calls + 1
            out.append(f"Some steps 3 + 4 = 7.\n#### {self.targets[k] + (k % 2):,.0f}")
        return out


def test_accuracy_counts_matches(tmp_path, monkeypatch) -> None:
    data = GSM8KTask().load(write_gsm8k(tmp_path, n_test=5), EvalSettings())
    monkeypatch.setattr("mindspeed_llm.evaluation.gsm8k.encode_context", lambda tok, text: [1])
    result = GSM8KTask().run(_EchoLM([p.target for p in data.problems]), data, EvalSettings(show_progress=False))
    assert [s["correct"] for s in result.samples] == [True, False, True, False, True]
    assert result.value == result.metrics["exact_match"] == 3 / 5 and result.n == 5


def _greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    """Token-by-token argmax without a cache, stopped at EOS; then cut at the first stop string."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(token)
            if token == tok.eos_token_id:
                break
    text = tok.decode(new)
    for marker in STOP + [tok.eos_token]:
        text = text.split(marker)[0]
    return text


def test_generation_matches_an_independent_greedy_loop(tmp_path, tiny_hf) -> None:
    model, tok = tiny_hf
    data = GSM8KTask().load(write_gsm8k(tmp_path, n_test=4), EvalSettings(shots=1))
    settings = EvalSettings(shots=1, max_new_tokens=10, show_progress=False)
    result = GSM8KTask().run(TransformersLM(model, tok, batch_size=2), data, settings)
    for sample, problem in zip(result.samples, data.problems):
        expected = _greedy(model, tok, build_prompt(data.examples, problem), 10)
        assert sample["generation"] == expected  # how predictions are scored: test_math_answer.py
    assert any(s["generation"] for s in result.samples)


def test_evaluate_scores_by_the_same_grader(tmp_path, monkeypatch) -> None:
    """``evaluate --task gsm8k`` marks a generation right exactly when :func:`~mindspeed.evaluation.math_answer.grade_answer` does."""
    responses = [r for r, _, _ in GRADES]
    references = [reference_answer(ref) for _, ref, _ in GRADES]
    lines = [json.dumps({"question": f"q{i}", "answer": f"steps\n#### {ref}"}) for i, ref in enumerate(references)]
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n")
    data = GSM8KTask().load(tmp_path, EvalSettings())
    monkeypatch.setattr("mindspeed_llm.evaluation.gsm8k.encode_context", lambda tok, text: [1])

    class _Replay:
        tokenizer, max_seq_len = None, 1024

        def generate(self, prompts, max_new_tokens, stop):
            return responses[: len(prompts)]

    result = GSM8KTask().run(_Replay(), data, EvalSettings(show_progress=False))
    assert [s["correct"] for s in result.samples] == [right for _, _, right in GRADES]
