"""GSM8K: grade-school math word problems, scored by greedy generation and answer extraction.

Data: JSON Lines with ``question`` and ``answer`` (the worked solution ending in
``#### <number>``), as in the original release: a ``.jsonl`` file, or a directory holding
``test.jsonl``. Few-shot examples (``--shots``, default 0) are the first records of
``train.jsonl`` next to it.

The prompt is ``Question: <question>\\nAnswer:``, examples are followed by their full solution
and a blank line. Generation is greedy and stops at ``Question:`` (the model starting the next
problem), EOS, or ``--max-new-tokens``. The prediction is read and compared by the suite's one
math-answer grader (:mod:`mindspeed.evaluation.math_answer`, the RL ``math`` reward's too):
the last ``\\boxed{}``, else the first ``#### <number>`` (lm-evaluation-harness strict-match),
else the last number; equal by value (commas dropped, ``5.0`` equals ``5``, ``0.5`` equals
``1/2``). The metric is exact-match accuracy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mindspeed.evaluation.math_answer import answers_equal, extract_answer, extract_marked, parse_number
from mindspeed.metrics.report import TaskResult
from mindspeed_llm.evaluation.lm import encode_context
from mindspeed_llm.evaluation.tasks import (
    DEFAULT_MAX_NEW_TOKENS,
    TASKS,
    EvalSettings,
    call_in_chunks,
    iter_jsonl,
    limit,
    require_path,
)

#: Text that ends a generation: the model moving on to a new question.
STOP = ["Question:", "</s>", "<|im_end|>"]


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One GSM8K record.

    Attributes:
        question: the problem.
        answer: the reference solution text (ending in ``#### <number>``).
        reference: the reference answer (the text of its ``#### <number>``).
        target: the reference number.
    """

    question: str
    answer: str
    reference: str
    target: float


@dataclasses.dataclass
class GSM8KData:
    """Loaded GSM8K files.

    Attributes:
        path: the test file.
        problems: the test problems.
        examples: few-shot examples (the first ``shots`` training records).
    """

    path: Path
    problems: list[MathProblem]
    examples: list[MathProblem]


def read_gsm8k(path: Path) -> list[MathProblem]:
    """The problems of a GSM8K JSON Lines file.

    Raises:
        ValueError: a record without ``question``/``answer`` strings or without ``#### <number>``, naming file and line.
    """
    problems = []
    for number, record in iter_jsonl(path):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise ValueError(
                f"{path}:{number}: expected string fields 'question' and 'answer', got keys {sorted(record)}"
            )
        reference = extract_marked(answer)
        value = None if reference is None else parse_number(reference)
        if value is None:
            raise ValueError(
                f"{path}:{number}: the answer must end with '#### <number>' (the GSM8K format), got {answer[-40:]!r}"
            )
        problems.append(MathProblem(question, answer, reference, float(value)))
    return problems


def format_problem(problem: MathProblem, with_answer: bool) -> str:
    """``Question: ...\\nAnswer:``, followed by the solution and a blank line for a few-shot example."""
    text = f"Question: {problem.question}\nAnswer:"
    return f"{text} {problem.answer}\n\n" if with_answer else text


def build_prompt(examples: list[MathProblem], problem: MathProblem) -> str:
    """The few-shot examples, then ``problem``."""
    return "".join(format_problem(example, True) for example in examples) + format_problem(problem, False)


class GSM8KTask:
    """The ``gsm8k`` task (see the module docstring)."""

    default_shots = 0

    def load(self, path: Path, settings: EvalSettings) -> GSM8KData:
        """Read the test file (``path`` or ``path/test.jsonl``) and, for few-shot, ``train.jsonl`` beside it.

        Raises:
            ValueError: a missing file, too few training records, or a malformed record.
        """
        path = Path(path)
        fix = "pass a GSM8K .jsonl file or a directory holding test.jsonl"
        require_path(path, "GSM8K data", fix)
        test_file = require_path(path / "test.jsonl", "GSM8K test file", fix) if path.is_dir() else path
        problems = limit(read_gsm8k(test_file), settings.max_samples)
        if not problems:
            raise ValueError(f"{test_file} holds no problems")
        shots = self.default_shots if settings.shots is None else settings.shots
        examples: list[MathProblem] = []
        if shots:
            train_file = require_path(
                test_file.parent / "train.jsonl",
                "GSM8K train file",
                f"the {shots}-shot examples come from it; add it or pass --shots 0",
            )
            examples = read_gsm8k(train_file)[:shots]
            if len(examples) < shots:
                raise ValueError(f"{train_file} has {len(examples)} problems, fewer than --shots {shots}")
        return GSM8KData(test_file, problems, examples)

    @staticmethod
    def max_new_tokens(lm: Any, settings: EvalSettings) -> int:
        """``--max-new-tokens``, else the default capped at half the model's window."""
        return settings.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, lm.max_seq_len // 2)

    def check(self, lm: Any, settings: EvalSettings) -> None:
        """The generation budget must leave room for a prompt in the window.

        Raises:
            ValueError: ``--max-new-tokens`` not below ``max_seq_len``.
        """
        budget = self.max_new_tokens(lm, settings)
        if budget >= lm.max_seq_len:
            raise ValueError(
                f"--max-new-tokens {budget} leaves no room for a prompt in the model's window of "
                f"{lm.max_seq_len} tokens; pass a smaller --max-new-tokens"
            )

    def run(self, lm: Any, data: GSM8KData, settings: EvalSettings) -> TaskResult:
        """Generate a solution per problem and compare its final number with the reference."""
        budget = self.max_new_tokens(lm, settings)
        prompts = [encode_context(lm.tokenizer, build_prompt(data.examples, p)) for p in data.problems]
        texts = call_in_chunks(lambda part: lm.generate(part, budget, STOP), prompts, lm, "gsm8k", settings)
        samples = []
        for index, (problem, text) in enumerate(zip(data.problems, texts)):
            prediction = extract_answer(text)
            correct = prediction is not None and answers_equal(prediction, problem.reference)
            samples.append(
                {
                    "index": index,
                    "generation": text,
                    "prediction": prediction,
                    "target": problem.target,
                    "correct": correct,
                }
            )
        accuracy = sum(s["correct"] for s in samples) / len(samples)
        return TaskResult(
            task="gsm8k",
            metric="exact_match",
            value=accuracy,
            n=len(samples),
            metrics={"exact_match": accuracy},
            samples=samples,
            settings={"data": str(data.path), "shots": len(data.examples), "max_new_tokens": budget, "stop": STOP},
        )


TASKS.register("gsm8k", GSM8KTask())
