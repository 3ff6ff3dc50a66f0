"""The reward-model demo's synthetic pairs: right vs wrong sums, held-out questions never trained on."""

from __future__ import annotations

import json
import re

import pytest

from mindspeed_llm.data.arithmetic_pairs import arithmetic_pairs, arithmetic_questions, write_arithmetic_pairs

ANSWER = re.compile(r"^ #### (\d+)$")
CUT = re.compile(r"^ #### (\d)\D$")  # the first digit, then junk
JUNK = re.compile(r"^ #### \D{1,2}$")  # no number


def _value(instruction: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", instruction).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_pairs_are_right_vs_wrong_and_the_held_out_questions_are_new(tmp_path) -> None:
    train, test = arithmetic_pairs(seed=3, held_out=50, pairs_per_question=2)
    questions = arithmetic_questions()
    assert len(questions) == 21 * 21 + 21 * 22 // 2  # every sum, every non-negative difference
    assert len(test) == 50 * 4 and len(train) == 2 * (len(questions) - 50)
    kinds = {"far": 0, "cut": 0, "junk": 0}
    for pair in [*train, *test]:
        right = _value(pair["instruction"])
        assert int(ANSWER.match(pair["chosen"]).group(1)) == right
        rejected = pair["rejected"]
        if ANSWER.match(rejected):
            kinds["far"] += 1
            assert abs(int(ANSWER.match(rejected).group(1)) - right) >= 10 and 0 <= int(rejected[6:]) <= 40
        elif CUT.match(rejected):
            kinds["cut"] += 1
            assert right >= 10 and CUT.match(rejected).group(1) == str(right)[0]
        else:
            kinds["junk"] += 1
            assert JUNK.match(rejected), rejected
    assert min(kinds.values()) > 0.15 * sum(kinds.values()), kinds  # a mix of the three
    assert not {p["instruction"] for p in test} & {p["instruction"] for p in train}
    assert arithmetic_pairs(seed=3, held_out=50, pairs_per_question=2) == (train, test)  # seeded
    assert arithmetic_pairs(seed=4, held_out=50) != (train, test)
    path, n_train, n_test = write_arithmetic_pairs(
        tmp_path / "d" / "pairs.jsonl", seed=3, held_out=50, pairs_per_question=2
    )
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [*train, *test] and (n_train, n_test) == (len(train), 200)
    assert [p.name for p in path.parent.iterdir()] == ["pairs.jsonl"]  # nothing half-written left
    with pytest.raises(ValueError, match="held_out=0 must be in"):
        arithmetic_pairs(held_out=0)
    named = ["What is 9 - 5?", "What is 1 + 13?"]
    train, test = arithmetic_pairs(held_out=named, held_out_pairs_per_question=1)
    assert sorted(p["instruction"] for p in test) == sorted(named)
    assert not set(named) & {p["instruction"] for p in train}
    with pytest.raises(ValueError, match="unknown questions"):
        arithmetic_pairs(held_out=["What is 99 + 1?"])
    with pytest.raises(ValueError, match="min_error=21"):
        arithmetic_pairs(min_error=21)
