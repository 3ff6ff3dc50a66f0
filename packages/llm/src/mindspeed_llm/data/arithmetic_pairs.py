"""Synthetic preference pairs for a reward-model demo: a right and a wrong answer to a sum.

Each record is an Alpaca-style pair that ``preprocess-data --handler-name
AlpacaStylePairwiseHandler`` reads::

    {"instruction": "What is 12 + 13?", "input": "", "chosen": " #### 25", "rejected": " #### 37"}
    {"instruction": "What is 12 + 13?", "input": "", "chosen": " #### 25", "rejected": " #### 2k"}

The questions are those of the RL arithmetic demo (sums and differences of 0..20 with
non-negative results) and the answers are in its GSM8K ``#### N`` form, so a reward model
trained on them scores what the demo policy writes. The wrong answers are the mistakes a sampled
tiny policy makes that a tiny reward model can judge: a quarter have no number at all (one or two
junk characters, `` #### ;k``), a quarter (of the right answers >= 10) are cut after the first
digit and end in junk (`` #### 2k`` for 25), the rest are a number drawn uniformly from the
answers' range (0..40) at least ``min_error`` away from the right one. Every one is wrong for
the ``math`` verifier. With the default ``min_error`` 10 a 2-layer model started from the demo
policy learns to tell them apart on new questions; answers off by 1 or 2 it does not (the demo
policy itself ranks an answer off by 1 below the right one on only 69 % of its held-out
questions; docs/llm/reward-model.md, "Demo").
:func:`write_arithmetic_pairs` writes the training pairs and then held-out pairs whose
*questions* do not occur in training.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

#: Characters of a malformed answer: printable ASCII without digits (no number can be read from them).
JUNK = [chr(c) for c in range(33, 127) if not chr(c).isdigit()]


def arithmetic_questions(max_operand: int = 20) -> list[tuple[str, int]]:
    """Every ``a + b`` and ``a - b`` (``a, b`` in ``0..max_operand``, result >= 0) with its value, in a fixed order."""
    out = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            out.append((f"{a} + {b}", a + b))
            if a >= b:
                out.append((f"{a} - {b}", a - b))
    return out


def _question(expression: str) -> str:
    return f"What is {expression}?"


def _wrong_reply(rng: random.Random, value: int, largest: int, min_error: int) -> str:
    kind = rng.random()
    if kind < 0.25:  # no number at all: what a sampled policy often writes
        return " #### " + "".join(rng.choice(JUNK) for _ in range(rng.randint(1, 2)))
    if kind < 0.5 and value >= 10:  # cut after the first digit (another number), then junk
        return f" #### {str(value)[0]}{rng.choice(JUNK)}"
    wrong = value
    while abs(wrong - value) < min_error:
        wrong = rng.randint(0, largest)
    return f" #### {wrong}"


def _pair(rng: random.Random, expression: str, value: int, largest: int, min_error: int) -> dict[str, str]:
    return {
        "instruction": _question(expression),
        "input": "",
        "chosen": f" #### {value}",
        "rejected": _wrong_reply(rng, value, largest, min_error),
    }


def arithmetic_pairs(
    seed: int = 0,
    held_out: int | Sequence[str] = 100,
    pairs_per_question: int = 8,
    max_operand: int = 20,
    min_error: int = 10,
    held_out_pairs_per_question: int = 4,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, held_out)`` preference pairs; the held-out questions are not among the training ones.

    Args:
        seed: shuffles the questions and draws the wrong answers.
        held_out: how many questions to keep out of training (drawn at random), or the questions
            themselves (``"What is 9 - 5?"``, e.g. the RL demo's held-out prompts).
        pairs_per_question: training pairs per question (each with its own wrong answer drawn).
        max_operand: the largest operand.
        min_error: the least distance of a wrong answer from the right one (1..``max_operand``).
        held_out_pairs_per_question: held-out pairs per held-out question.

    Raises:
        ValueError: ``held_out`` leaves no training question or names an unknown question, a
            count below 1, or ``min_error`` outside ``1..max_operand``.
    """
    questions = arithmetic_questions(max_operand)
    if isinstance(held_out, int):
        if not 0 < held_out < len(questions):
            raise ValueError(f"held_out={held_out} must be in (0, {len(questions)})")
    else:
        unknown = sorted(set(held_out) - {_question(e) for e, _ in questions})
        if unknown or not 0 < len(set(held_out)) < len(questions):
            raise ValueError(
                f"held_out names {len(unknown)} unknown questions (e.g. {unknown[:1]}) or leaves no training "
                f"question; give 'What is a + b?' / 'What is a - b?' questions with operands 0..{max_operand}"
            )
    if pairs_per_question < 1 or held_out_pairs_per_question < 1 or not 1 <= min_error <= max_operand:
        raise ValueError(
            f"pairs_per_question={pairs_per_question} and held_out_pairs_per_question={held_out_pairs_per_question} "
            f"must be >= 1 and min_error={min_error} in 1..{max_operand}"
        )
    rng = random.Random(seed)
    rng.shuffle(questions)
    if isinstance(held_out, int):
        test, train = questions[:held_out], questions[held_out:]
    else:
        names = set(held_out)
        test = [q for q in questions if _question(q[0]) in names]
        train = [q for q in questions if _question(q[0]) not in names]
    largest = 2 * max_operand
    train_pairs = [_pair(rng, e, v, largest, min_error) for _ in range(pairs_per_question) for e, v in train]
    rng.shuffle(train_pairs)
    test_pairs = [_pair(rng, e, v, largest, min_error) for e, v in test for _ in range(held_out_pairs_per_question)]
    return train_pairs, test_pairs


def write_arithmetic_pairs(path: str | Path, seed: int = 0, **settings: object) -> tuple[Path, int, int]:
    """Write the training pairs, then the held-out ones, into one jsonl file (atomically).

    ``data.split: "<train>,<held-out>,0"`` with the two counts returned makes the held-out pairs
    the validation split exactly (the split cuts the file's records in order). ``settings`` are
    :func:`arithmetic_pairs`'s.

    Returns:
        The path, the number of training pairs and the number of held-out pairs.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    train, test = arithmetic_pairs(seed, **settings)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in [*train, *test]))
    os.replace(tmp, path)
    return path, len(train), len(test)
