"""The calculator equals Python's arithmetic on random expressions and refuses everything else, cheaply."""

from __future__ import annotations

import math
import operator
import random
import time

import pytest

from mindspeed_rl.tools import TOOLS, ToolError, call_tool, evaluate

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv}
OPS |= {"%": operator.mod, "**": operator.pow}


def random_expression(rng: random.Random, depth: int) -> tuple[str, int | float]:
    """A fully parenthesised expression and its value computed by Python's operators (no eval)."""
    if depth == 0 or rng.random() < 0.3:
        value = rng.choice([rng.randint(0, 999), round(rng.uniform(0, 100), rng.randint(0, 3))])
        return repr(value), value
    if rng.random() < 0.15:
        text, value = random_expression(rng, depth - 1)
        return f"-({text})", -value
    symbol = rng.choice(list(OPS))
    (left_text, left), (right_text, right) = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    if symbol == "**":  # keep powers small so the reference never overflows
        right = rng.randint(0, 3)
        right_text = repr(right)
    return f"({left_text}) {symbol} ({right_text})", OPS[symbol](left, right)


def test_random_expressions_equal_python() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(600):
        try:
            text, value = random_expression(rng, 4)
        except (ZeroDivisionError, OverflowError):
            continue
        if isinstance(value, complex) or (isinstance(value, int) and value.bit_length() > 4096):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        result = evaluate(text)
        assert result == value and type(result) is type(value), text
        checked += 1
    assert checked > 400


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2+3*4", 14),
        ("-2**2", -4),
        ("2**-1", 0.5),
        ("2**3**2", 512),
        ("7//2", 3),
        ("-7//2", -4),
        ("7 % -3", -2),
        ("(1 + 2) * 3", 9),
        ("10/4", 2.5),
        ("1_000 + 1", 1001),
        ("1e3", 1000.0),
        ("+5 - -5", 10),
        ("123456789 * 987654321", 121932631112635269),
        ("2**4095 // 2**4094", 2),
    ],
)
def test_precedence_and_forms(text: str, value: int | float) -> None:
    assert evaluate(text) == value


REFUSED = [
    "__import__('os').system('true')",
    "x",
    "(1).real",
    "abs(-1)",
    "'a' * 3",
    "[1, 2]",
    "1 if 1 else 2",
    "1 < 2",
    "~1",
    "1 << 2",
    "1 & 2",
    "(x := 1)",
    "lambda: 1",
    "True + 1",
    "1j",
    "1; 2",
    "",
    "9**9**9",
    "2**100000",
    "10**5000",
    "9999999999 ** 400",
    "1e308 * 10",
    "1e308 ** 2",
    "10**1000 / 3 * 1e300",
    "1 / 0",
    "1 % 0",
    "1 // 0.0",
    "(-8) ** 0.5",
    "1" * 1001,
    "(" * 300 + "1" + ")" * 300,
    "-" * 500 + "1",
]


def test_refusals_are_cheap_tool_errors() -> None:
    tool = TOOLS.get("calculator")()
    start = time.process_time()
    for text in REFUSED:
        with pytest.raises(ToolError):
            evaluate(text)
        result = call_tool(tool, "calculator", {"expression": text})
        assert not result.ok and result.content.startswith("error:"), (text, result)
    assert time.process_time() - start < 2.0, "a refusal must be decided before computing anything large"
    assert call_tool(tool, "calculator", {"expression": "6*7"}).content == "42"
    assert call_tool(tool, "calculator", {"expression": "1/4"}).content == "0.25"
