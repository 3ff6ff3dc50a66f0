"""MMLU: multiple choice in the original (hendrycks) release format, scored by log-likelihood.

Data: a directory with ``test/<subject>_test.csv`` and, for few-shot prompts,
``dev/<subject>_dev.csv`` (also found under ``data/`` as the release tarball unpacks). The CSV
files have no header and six columns: question, the choices A to D, and the answer letter.

The prompt is the standard one: a line naming the subject, the first ``shots`` dev questions
with their answers, then the test question ending in ``Answer:``. The model's choice is the letter
whose continuation (`` A`` ... `` D``) has the highest log-likelihood. Accuracy is reported per
subject, over all questions (micro, the headline) and as the mean over subjects (macro).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any

from mindspeed.metrics.report import TaskResult
from mindspeed_llm.evaluation.lm import encode_pair
from mindspeed_llm.evaluation.tasks import TASKS, EvalSettings, call_in_chunks, limit, require_path

LETTERS = ("A", "B", "C", "D")


@dataclasses.dataclass(frozen=True)
class ChoiceQuestion:
    """One MMLU row.

    Attributes:
        question: the question text.
        choices: the four answers, A to D.
        answer: the right letter.
    """

    question: str
    choices: tuple[str, str, str, str]
    answer: str


@dataclasses.dataclass
class MMLUData:
    """Loaded MMLU files.

    Attributes:
        root: the directory holding ``dev/`` and ``test/``.
        subjects: subject -> (dev questions, test questions), subjects sorted by name.
        shots: few-shot examples per prompt.
    """

    root: Path
    subjects: dict[str, tuple[list[ChoiceQuestion], list[ChoiceQuestion]]]
    shots: int


def read_mmlu_csv(path: Path) -> list[ChoiceQuestion]:
    """The questions of one MMLU CSV file.

    Raises:
        ValueError: a row without six columns or with an answer other than A-D, naming file and line.
    """
    questions = []
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        for row in reader:
            if not row or not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != 6:
                raise ValueError(
                    f"{where}: expected 6 columns (question, A, B, C, D, answer letter) without a header, "
                    f"got {len(row)}"
                )
            answer = row[5].strip().upper()
            if answer not in LETTERS:
                raise ValueError(f"{where}: the answer column must be one of A, B, C, D, got {row[5]!r}")
            questions.append(ChoiceQuestion(row[0], (row[1], row[2], row[3], row[4]), answer))
    return questions


def format_subject(subject: str) -> str:
    """``abstract_algebra`` -> ``abstract algebra``."""
    return subject.replace("_", " ")


def format_question(question: ChoiceQuestion, with_answer: bool) -> str:
    """The question, its lettered choices and ``Answer:`` (followed by the letter for few-shot examples)."""
    text = question.question + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, question.choices))
    text += "\nAnswer:"
    return text + f" {question.answer}\n\n" if with_answer else text


def build_prompt(subject: str, dev: list[ChoiceQuestion], question: ChoiceQuestion, shots: int) -> str:
    """The standard MMLU prompt for ``question`` with the first ``shots`` dev questions as examples."""
    header = f"The following are multiple choice questions (with answers) about {format_subject(subject)}.\n\n"
    return (
        header + "".join(format_question(example, True) for example in dev[:shots]) + format_question(question, False)
    )


def _find_root(path: Path) -> Path:
    require_path(
        path, "MMLU data directory", "pass the directory that holds test/<subject>_test.csv and dev/<subject>_dev.csv"
    )
    for root in (path, path / "data"):
        if (root / "test").is_dir():
            return root
    raise ValueError(
        f"MMLU data directory {str(path)!r} has no test/ folder; expected test/<subject>_test.csv "
        f"and dev/<subject>_dev.csv (the layout of the original release)"
    )


class MMLUTask:
    """The ``mmlu`` task (see the module docstring)."""

    default_shots = 5

    def load(self, path: Path, settings: EvalSettings) -> MMLUData:
        """Read every subject under ``path``; dev files are required when ``shots > 0``.

        Raises:
            ValueError: no test files, a missing or too short dev file, or a malformed row.
        """
        root = _find_root(Path(path))
        shots = self.default_shots if settings.shots is None else settings.shots
        tests = sorted((root / "test").glob("*_test.csv"))
        if not tests:
            raise ValueError(f"{root / 'test'} holds no <subject>_test.csv files")
        subjects = {}
        for test_file in tests:
            subject = test_file.name[: -len("_test.csv")]
            dev: list[ChoiceQuestion] = []
            if shots:
                dev_file = root / "dev" / f"{subject}_dev.csv"
                require_path(
                    dev_file, "MMLU dev file", f"add it or pass --shots 0 (the {shots}-shot examples come from it)"
                )
                dev = read_mmlu_csv(dev_file)
                if len(dev) < shots:
                    raise ValueError(
                        f"{dev_file} has {len(dev)} questions, fewer than --shots {shots}; add examples or lower --shots"
                    )
            questions = limit(read_mmlu_csv(test_file), settings.max_samples)
            if not questions:
                raise ValueError(f"{test_file} holds no questions")
            subjects[subject] = (dev, questions)
        return MMLUData(root, subjects, shots)

    def check(self, lm: Any, settings: EvalSettings) -> None:
        """Nothing to check: prompts longer than the window lose their left part."""

    def run(self, lm: Any, data: MMLUData, settings: EvalSettings) -> TaskResult:
        """Pick the most likely letter for every test question; accuracy per subject, micro and macro."""
        requests, keys = [], []
        for subject, (dev, questions) in data.subjects.items():
            for index, question in enumerate(questions):
                prompt = build_prompt(subject, dev, question, data.shots)
                for letter in LETTERS:
                    requests.append(encode_pair(lm.tokenizer, prompt, f" {letter}"))
                keys.append((subject, index, question))
        scores = call_in_chunks(lm.loglikelihood, requests, lm, "mmlu", settings)
        samples, groups = [], {}
        for k, (subject, index, question) in enumerate(keys):
            choice_scores = scores[4 * k : 4 * k + 4]
            prediction = LETTERS[max(range(4), key=lambda c: choice_scores[c])]  # first letter wins a tie
            samples.append(
                {
                    "subject": subject,
                    "index": index,
                    "loglikelihoods": choice_scores,
                    "prediction": prediction,
                    "target": question.answer,
                    "correct": prediction == question.answer,
                }
            )
        for subject in data.subjects:
            hits = [s["correct"] for s in samples if s["subject"] == subject]
            groups[subject] = {"acc": sum(hits) / len(hits), "n": len(hits)}
        micro = sum(s["correct"] for s in samples) / len(samples)
        macro = sum(g["acc"] for g in groups.values()) / len(groups)
        return TaskResult(
            task="mmlu",
            metric="acc",
            value=micro,
            n=len(samples),
            metrics={"acc": micro, "acc_macro": macro},
            groups=groups,
            samples=samples,
            settings={"data": str(data.root), "shots": data.shots, "subjects": len(groups)},
        )


TASKS.register("mmlu", MMLUTask())
