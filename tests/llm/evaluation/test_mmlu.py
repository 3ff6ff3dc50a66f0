"""MMLU: the standard prompt, CSV checks, and letter choice by independently computed log-likelihoods."""

from __future__ import annotations

import pytest
import torch

from mindspeed_llm.evaluation import EvalSettings, TransformersLM
from mindspeed_llm.evaluation.mmlu import ChoiceQuestion, MMLUTask, build_prompt

from .conftest import write_mmlu


def test_prompt_is_the_standard_format() -> None:
    dev = [
        ChoiceQuestion("What is 1 + 1?", ("1", "2", "3", "4"), "B"),
        ChoiceQuestion("Pick the color.", ("red", "dog", "cat", "sun"), "A"),
    ]
    question = ChoiceQuestion("Which is even?", ("3", "5", "8", "9"), "C")
    expected = (
        "The following are multiple choice questions (with answers) about high school math.\n\n"
        "What is 1 + 1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n"
        "Pick the color.\nA. red\nB. dog\nC. cat\nD. sun\nAnswer: A\n\n"
        "Which is even?\nA. 3\nB. 5\nC. 8\nD. 9\nAnswer:"
    )
    assert build_prompt("high_school_math", dev, question, shots=2) == expected
    assert build_prompt("high_school_math", dev, question, shots=0).endswith(
        "about high school math.\n\nWhich is even?\nA. 3\nB. 5\nC. 8\nD. 9\nAnswer:"
    )


def test_load_reads_the_release_layout(tmp_path) -> None:
    write_mmlu(tmp_path / "data", {"b_subject": 3, "a_subject": 2})
    data = MMLUTask().load(tmp_path, EvalSettings(max_samples=2))  # the tarball's data/ level is found
    assert list(data.subjects) == ["a_subject", "b_subject"] and data.shots == 5
    assert [len(test) for _, test in data.subjects.values()] == [2, 2]


def _bad_csv(tmp_path, line: str) -> str:
    write_mmlu(tmp_path, {"s": 2})
    with open(tmp_path / "test" / "s_test.csv", "a", encoding="utf-8") as handle:
        handle.write(line)
    with pytest.raises(ValueError) as err:
        MMLUTask().load(tmp_path, EvalSettings())
    return str(err.value)


def test_bad_rows_name_file_and_line(tmp_path) -> None:
    message = _bad_csv(tmp_path, "only,four,columns,here\n")
    assert "s_test.csv:3:" in message and "6 columns" in message and "got 4" in message
    message = _bad_csv(tmp_path / "x", "q,a,b,c,d,E\n")
    assert "s_test.csv:3:" in message and "A, B, C, D" in message


def test_few_shot_needs_dev_files(tmp_path) -> None:
    write_mmlu(tmp_path, {"s": 2}, dev_rows=2)
    with pytest.raises(ValueError, match="fewer than --shots 5"):
        MMLUTask().load(tmp_path, EvalSettings())
    (tmp_path / "dev" / "s_dev.csv").unlink()
    with pytest.raises(ValueError, match="s_dev.csv.*--shots 0"):
        MMLUTask().load(tmp_path, EvalSettings(shots=2))
    assert MMLUTask().load(tmp_path, EvalSettings(shots=0)).shots == 0


def _independent_loglikelihood(model, tok, prompt: str, letter: str, max_seq_len: int) -> float:
    """log p(" X" | prompt) from one unbatched transformers forward, left-truncated to the window."""
    whole = tok(prompt + " " + letter, add_special_tokens=False)["input_ids"]
    context = tok(prompt, add_special_tokens=False)["input_ids"]
    assert whole[: len(context)] == context
    ids = whole[-max_seq_len:]
    n = len(whole) - len(context)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(logprobs[len(ids) - 1 - n + k, ids[len(ids) - n + k]]) for k in range(n))


@pytest.mark.parametrize("max_seq_len", [4096, 48])  # 48: 5-shot prompts lose their left part
def test_choice_is_argmax_of_transformers_loglikelihoods(tmp_path, tiny_hf, max_seq_len) -> None:
    model, tok = tiny_hf
    data = MMLUTask().load(write_mmlu(tmp_path, {"alpha": 3, "beta": 3}), EvalSettings())
    result = MMLUTask().run(
        TransformersLM(model, tok, batch_size=3, max_seq_len=max_seq_len), data, EvalSettings(show_progress=False)
    )
    assert result.n == 6
    for sample in result.samples:
        dev, questions = data.subjects[sample["subject"]]
        prompt = build_prompt(sample["subject"], dev, questions[sample["index"]], 5)
        expected = [_independent_loglikelihood(model, tok, prompt, letter, max_seq_len) for letter in "ABCD"]
        torch.testing.assert_close(torch.tensor(sample["loglikelihoods"]), torch.tensor(expected), rtol=0, atol=1e-4)
        assert sample["prediction"] == "ABCD"[int(torch.tensor(expected).argmax())]
        assert sample["correct"] == (sample["prediction"] == questions[sample["index"]].answer)
    per_subject = {s: [x["correct"] for x in result.samples if x["subject"] == s] for s in ("alpha", "beta")}
    assert result.groups == {s: {"acc": sum(v) / len(v), "n": len(v)} for s, v in per_subject.items()}
    assert result.value == result.metrics["acc"] == sum(x["correct"] for x in result.samples) / 6
    assert result.metrics["acc_macro"] == pytest.approx(sum(sum(v) / len(v) for v in per_subject.values()) / 2)
