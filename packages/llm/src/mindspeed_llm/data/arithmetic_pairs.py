"""Synthetic preference pairs for a reward-model demo: a right and a wrong answer to a sum.

Each record is an Alpaca-style pair that ``preprocess-data --handler-name
AlpacaStylePairwiseHandler`` reads::

    {"instruction": "What is 12 + 13?", "input": "", "chosen": " #### 25", "rejected": " #### 27"}

The questions are those of the RL arithmetic demo (sums and differences of 0..20 with
non-negative results) and the answers are in its GSM8K ``#### N`` form, so a reward model
trained on them scores what the demo policy writes. The wrong answer is off by a small amount
(1, 2 or 10, either way: the mistakes a model makes), never negative. :func:`write_arithmetic_pairs`
writes the training pairs and then held-out pairs whose *questions* do not occur in training.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

#: Offsets of the wrong answer from the right one.
MISTAKES = (-10, -2, -1, 1, 2, 10)


def arithmetic_questions(max_operand: int = 20) -> list[tuple[str, int]]:
    """Every ``a + b`` and ``a - b`` (``a, b`` in ``0..max_operand``, result >= 0) with its value, in a fixed order."""
    out = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            out.append((f"{a} + {b}", a + b))
            if a >= b:
                out.append((f"{a} - {b}", a - b))
    return out


def _pair(rng: random.Random, expression: str, value: int) -> dict[str, str]:
    wrong = value
    while wrong == value or wrong < 0:
        wrong = value + rng.choice(MISTAKES)
    return {
        "instruction": f"What is {expression}?",
        "input": "",
        "chosen": f" #### {value}",
        "rejected": f" #### {wrong}",
    }


def arithmetic_pairs(
    seed: int = 0, held_out: int = 100, pairs_per_question: int = 2, max_operand: int = 20
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``(train, held_out)`` preference pairs; the held-out questions are not among the training ones.

    Args:
        seed: shuffles the questions and draws the wrong answers.
        held_out: questions kept out of training (one pair each).
        pairs_per_question: training pairs per question (each with its own wrong answer drawn).
        max_operand: the largest operand.

    Raises:
        ValueError: ``held_out`` leaves no training question, or ``pairs_per_question < 1``.
    """
    questions = arithmetic_questions(max_operand)
    if not 0 < held_out < len(questions) or pairs_per_question < 1:
        raise ValueError(
            f"held_out={held_out} must be in (0, {len(questions)}) and pairs_per_question={pairs_per_question} >= 1"
        )
    rng = random.Random(seed)
    rng.shuffle(questions)
    test, train = questions[:held_out], questions[held_out:]
    train_pairs = [_pair(rng, e, v) for _ in range(pairs_per_question) for e, v in train]
    rng.shuffle(train_pairs)
    return train_pairs, [_pair(rng, e, v) for e, v in test]


def write_arithmetic_pairs(path: str | Path, seed: int = 0, **settings: int) -> tuple[Path, int, int]:
    """Write the training pairs, then the held-out ones, into one jsonl file (atomically).

    ``data.split: "<train>,<held-out>,0"`` with the two counts returned makes the held-out pairs
    the validation split exactly (the split cuts the file's records in order).

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
