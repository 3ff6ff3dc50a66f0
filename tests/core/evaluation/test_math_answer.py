"""The one math-answer grader (evaluate and the RL reward): extraction and equivalence on tricky strings."""

from __future__ import annotations

from fractions import Fraction

import pytest

from mindspeed.evaluation.math_answer import (
    answers_equal,
    extract_answer,
    extract_boxed,
    grade_answer,
    parse_number,
    reference_answer,
)

MINUS = "\u2212"


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"The answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"nested \boxed{\sqrt{\frac{1}{2}}} end", r"\sqrt{\frac{1}{2}}"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{ {a, b} }", "{a, b}"),
        (r"\fbox{7}", "7"),
        (r"so \boxed 5 is it", "5"),
        (r"\boxed{unclosed {", None),
        ("no box here", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, strict, expected",
    [
        ("She has 3 apples and buys 4 more, so 7 apples.", False, "7"),
        ("The total is 1,234.", False, "1,234"),
        ("It costs $18.50 each", False, "18.50"),
        ("temperature drops to -12 degrees", False, "-12"),
        (f"temperature drops to {MINUS}12 degrees", False, "-12"),
        ("half is 3/4 of it", False, "3/4"),
        ("work...\n#### 72", False, "72"),
        ("#### 5\nextra words 9", False, "5"),  # the line after ####, not the last number
        ("#### 5 ... #### 7", False, "5 ..."),  # the first #### answer (lm-eval strict-match), read as 5
        ("#### 1/2", False, "1/2"),  # a fraction, not its numerator
        ("#### none yet\n#### 8", False, "8"),  # a #### without a number is skipped
        ("#### The answer is 18.", False, "18"),
        ("the change is 3-4 = -1 degrees", False, "-1"),  # a dash between numbers is no minus sign
        ("x=-5 apples", False, "-5"),
        ("1,2,3", False, "3"),  # commas that are not thousands separators split numbers
        ("3+4=7", False, "7"),
        ("42 #### no number after the marker", False, "42"),
        (r"#### 3 but \boxed{4}", False, "4"),  # a box beats ####
        ("no digits at all", False, None),
        ("The answer is 7", True, None),  # strict: only boxed or ####
        ("#### -3", True, "-3"),
        ("ends with ####", False, None),
        (".5 of the cake", False, ".5"),
    ],
)
def test_extract_answer(text: str, strict: bool, expected: str | None) -> None:
    assert extract_answer(text, strict=strict) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("-7", -7),
        ("+7", 7),
        ("3.50", Fraction(7, 2)),
        ("0.75", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("1,234", 1234),
        ("-1,234,567.5", Fraction(-2469135, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{-6}{8}", Fraction(-3, 4)),
        (r"\frac12", Fraction(1, 2)),
        (r"\$18", 18),
        ("$18.00", 18),
        ("50%", 50),
        (r"50\%", 50),
        ("1e3", 1000),
        ("72.", 72),
        (r"18 \text{ dollars}", 18),
        ("18 dollars", 18),
        (r"\text{5}", 5),
        (f"{MINUS}4", -4),
        (r"\left( 3 \right)", 3),
        ("{1,234}", 1234),
        ("(1)/(2)", Fraction(1, 2)),
        ("(-3)", -3),
        ("1/0", None),
        ("1,2", None),
        ("3 apples and 4 pears", None),
        ("x^2", None),
        ("2x", None),
        ("x = 5", 5),
        ("", None),
    ],
)
def test_parse_number(text: str, value: Fraction | int | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "prediction, reference, equal",
    [
        ("0.75", "3/4", True),
        (r"\frac{3}{4}", "0.75", True),
        ("1,234", "1234", True),
        ("1234.0", "1,234", True),
        ("-5", "5", False),
        ("18 dollars", "18", True),
        ("0.3333333", "1/3", True),
        ("0.333", "1/3", False),
        (r"\text{(B)}", "(b)", True),
        (r"x^{2} + 1", "x^{2}+1", True),
        ("x^2", "x^3", False),
        ("7", "seven", False),
    ],
)
def test_answers_equal(prediction: str, reference: str, equal: bool) -> None:
    assert answers_equal(prediction, reference) is equal


def test_reference_answer_forms() -> None:
    assert reference_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert reference_answer(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert reference_answer("  17 ") == "17"


# The three strings on which evaluate and the RL reward used to disagree, and more: (response, reference, right).
GRADES = [
    ("#### 5 ... #### 7", "#### 5", True),
    ("#### 5 ... #### 7", "#### 7", False),
    (r"\boxed{12} ... 13", "12", True),
    (r"\boxed{12} ... 13", "#### 13", False),
    ("#### 1/2", "0.5", True),
    ("#### 1/2", "1", False),
    ("so 3 + 4 = 7.\n#### 7", "Natalia ... <<3+4=7>>7\n#### 7", True),
    ("#### 1,000", "#### 1000", True),
    ("#### 1000.00", "1000", True),
    ("#### $18", "18", True),
    ("#### 50%", "#### 50", True),
    (r"\boxed{\frac{3}{4}}", "#### 0.75", True),
    ("#### -7", "#### 7", False),
    ("The answer is 72.", "#### 72", True),
    ("7 apples, then 8", "#### 7", False),
    ("no idea", "#### 7", False),
]


@pytest.mark.parametrize("response, reference, right", GRADES)
def test_grade_answer(response: str, reference: str, right: bool) -> None:
    assert grade_answer(response, reference) is right
