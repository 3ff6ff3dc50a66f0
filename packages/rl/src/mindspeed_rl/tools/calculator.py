"""The ``calculator`` tool: arithmetic by an AST walker, never ``eval``.

The expression is parsed with :func:`ast.parse` (parsing runs nothing) and walked: only number
literals, ``+ - * / // % **``, unary minus and plus, and parentheses pass; a name, an attribute,
a call, a subscript, a string or anything else is refused. Sizes are bounded before computing:
the text's length, the nesting depth, integers' bits (a product or power that would exceed
:data:`MAX_INT_BITS` is refused, so ``9**9**9`` costs nothing), and floats must stay finite.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from mindspeed_rl.tools.base import TOOLS, Tool, ToolError

MAX_LENGTH = 1000
MAX_DEPTH = 64
MAX_INT_BITS = 4096

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_WORDS = {ast.Call: "a function call", ast.Attribute: "an attribute", ast.Subscript: "a subscript"}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``.

    Raises:
        ToolError: anything that is not plain arithmetic, too large, or undefined (division by 0).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("error: the expression is empty", "bad_arguments")
    if len(expression) > MAX_LENGTH:
        raise ToolError(f"error: the expression is longer than {MAX_LENGTH} characters", "bad_arguments")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ToolError(f"error: not an arithmetic expression: {getattr(err, 'msg', err)}", "bad_arguments") from None
    return _walk(tree.body, 0)


def _walk(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise ToolError(f"error: the expression nests deeper than {MAX_DEPTH}", "bad_arguments")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
        _check_size(node.op, left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("error: division by zero", "math_error") from None
        except OverflowError:
            raise ToolError("error: the result is too large", "math_error") from None
        if isinstance(value, complex):
            raise ToolError("error: the result is not a real number", "math_error")
        return _checked(value)
    what = _WORDS.get(type(node), f"a {type(node).__name__} node")
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    elif isinstance(node, ast.Constant):
        what = f"a {type(node.value).__name__} literal"
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    raise ToolError(f"error: {what} is not allowed (numbers, + - * / // % **, parentheses only)", "bad_arguments")


def _bits(value: int | float) -> int:
    return abs(int(value)).bit_length() if isinstance(value, int) else 0


def _check_size(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse an integer product or power whose result would exceed MAX_INT_BITS, before computing it."""
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        if _bits(left) + _bits(right) > MAX_INT_BITS + 1:
            raise ToolError(f"error: the result would exceed {MAX_INT_BITS} bits", "math_error")
    if isinstance(op, ast.Pow):
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if (_bits(left) - 1) * right > MAX_INT_BITS:
                raise ToolError(f"error: the result would exceed {MAX_INT_BITS} bits", "math_error")
        if isinstance(right, int) and abs(right) > 10**6:  # float powers overflow or underflow anyway
            raise ToolError("error: the exponent is too large", "math_error")


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("error: the result is not finite", "math_error")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"error: the result exceeds {MAX_INT_BITS} bits", "math_error")
    return value


def format_value(value: int | float) -> str:
    """Integers exactly; floats by ``repr`` (the shortest text that reads back to the same float)."""
    return str(value) if isinstance(value, int) else repr(value)


def build_calculator() -> Tool:
    """The ``calculator`` tool."""
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (123 * 456) - 7"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        execute=lambda arguments: format_value(evaluate(arguments["expression"])),
    )


TOOLS.register("calculator", build_calculator)
