"""The reward-model demo's synthetic pairs: right vs wrong sums, held-out questions never trained on."""

from __future__ import annotations

import json
import re

import pytest

from mindspeed_llm.data.arithmetic_pairs import arithmetic_pairs, arithmetic_questions, write_arithmetic_pairs

ANSWER = re.compile(r"^ #### (\d+)$")


def _value(instruction: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", instruction).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_pairs_are_right_vs_wrong_and_the_held_out_questions_are_new(tmp_path) -> None:
    train, test = arithmetic_pairs(seed=3, held_out=50, pairs_per_question=2)
    questions = arithmetic_questions()
    assert len(questions) == 21 * 21 + 21 * 22 // 2  # every sum, every non-negative difference
    assert len(test) == 50 and len(train) == 2 * (len(questions) - 50)
    for pair in [*train, *test]:
        right = _value(pair["instruction"])
        chosen, rejected = (int(ANSWER.match(pair[k]).group(1)) for k in ("chosen", "rejected"))
        assert chosen == right and rejected != right and rejected >= 0 and abs(rejected - right) in (1, 2, 10)
    assert not {p["instruction"] for p in test} & {p["instruction"] for p in train}
    assert arithmetic_pairs(seed=3, held_out=50) == (train, test)  # seeded
    assert arithmetic_pairs(seed=4, held_out=50) != (train, test)
    path, n_train, n_test = write_arithmetic_pairs(tmp_path / "d" / "pairs.jsonl", seed=3, held_out=50)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [*train, *test] and (n_train, n_test) == (len(train), 50)
    assert [p.name for p in path.parent.iterdir()] == ["pairs.jsonl"]  # nothing half-written left
    with pytest.raises(ValueError, match="held_out=0 must be in"):
        arithmetic_pairs(held_out=0)
