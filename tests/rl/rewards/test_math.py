"""The math verifier: answer extraction and numeric equivalence on tricky strings."""

from __future__ import annotations

from fractions import Fraction

import pytest

from mindspeed_rl.rewards import MathVerifier, answers_equal, extract_answer, extract_boxed, parse_number, reference_answer

MINUS = "\u2212"


@pytest.mark.parametrize("text, expected", [
    (r"The answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
    (r"nested \boxed{\sqrt{\frac{1}{2}}} end", r"\sqrt{\frac{1}{2}}"),
    (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
    (r"\boxed{ {a, b} }", "{a, b}"),
    (r"\fbox{7}", "7"),
    (r"so \boxed 5 is it", "5"),
    (r"\boxed{unclosed {", None),
    ("no box here", None),
])
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, strict, expected", [
    ("She has 3 apples and buys 4 more, so 7 apples.", False, "7"),
    ("The total is 1,234.", False, "1,234"),
    ("It costs $18.50 each", False, "18.50"),
    ("temperature drops to -12 degrees", False, "-12"),
    (f"temperature drops to {MINUS}12 degrees", False, "-12"),
    ("half is 3/4 of it", False, "3/4"),
    ("work...\n#### 72", False, "72"),
    ("#### 5\nextra words 9", False, "5"),  # the line after ####, not the last number
    (r"#### 3 but \boxed{4}", False, "4"),  # a box beats ####
    ("no digits at all", False, None),
    ("The answer is 7", True, None),  # strict: only boxed or ####
    ("#### -3", True, "-3"),
    ("ends with ####", False, None),
    (".5 of the cake", False, ".5"),
])
def test_extract_answer(text: str, strict: bool, expected: str | None) -> None:
    assert extract_answer(text, strict=strict) == expected


@pytest.mark.parametrize("text, value", [
    ("42", 42), ("-7", -7), ("+7", 7), ("3.50", Fraction(7, 2)), ("0.75", Fraction(3, 4)), (".5", Fraction(1, 2)),
    ("1,234", 1234), ("-1,234,567.5", Fraction(-2469135, 2)), ("3/4", Fraction(3, 4)), ("-3/4", Fraction(-3, 4)),
    (r"\frac{3}{4}", Fraction(3, 4)), (r"\dfrac{-6}{8}", Fraction(-3, 4)), (r"\frac12", Fraction(1, 2)),
    (r"\$18", 18), ("$18.00", 18), ("50%", 50), (r"50\%", 50), ("1e3", 1000), ("72.", 72),
    (r"18 \text{ dollars}", 18), ("18 dollars", 18), (r"\text{5}", 5), (f"{MINUS}4", -4),
    (r"\left( 3 \right)", 3), ("{1,234}", 1234), ("(1)/(2)", Fraction(1, 2)), ("(-3)", -3), ("1/0", None),
    ("1,2", None), ("3 apples and 4 pears", None), ("x^2", None), ("2x", None), ("x = 5", 5), ("", None),
])
def test_parse_number(text: str, value: Fraction | int | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("prediction, reference, equal", [
    ("0.75", "3/4", True), (r"\frac{3}{4}", "0.75", True), ("1,234", "1234", True), ("1234.0", "1,234", True),
    ("-5", "5", False), ("18 dollars", "18", True), ("0.3333333", "1/3", True), ("0.333", "1/3", False),
    (r"\text{(B)}", "(b)", True), (r"x^{2} + 1", "x^{2}+1", True), ("x^2", "x^3", False), ("7", "seven", False),
])
def test_answers_equal(prediction: str, reference: str, equal: bool) -> None:
    assert answers_equal(prediction, reference) is equal


def test_reference_answer_forms() -> None:
    assert reference_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert reference_answer(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert reference_answer("  17 ") == "17"


def test_math_verifier_scores() -> None:
    verifier = MathVerifier()
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert verifier("q", r"She sold \boxed{72} clips.", gsm8k) == 1.0
    assert verifier("q", "48 + 24 = 72", gsm8k) == 1.0
    assert verifier("q", "48 + 24 = 72.0", "72") == 1.0
    assert verifier("q", "I think 71", gsm8k) == 0.0
    assert verifier("q", "no idea", gsm8k) == 0.0
    assert MathVerifier(strict=True)("q", "48 + 24 = 72", gsm8k) == 0.0
    assert MathVerifier(incorrect=-1.0)("q", "70", gsm8k) == -1.0
    with pytest.raises(ValueError, match="reference"):
        verifier("q", "72", None)
