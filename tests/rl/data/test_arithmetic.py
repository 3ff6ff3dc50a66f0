"""The generated arithmetic set: deterministic, checkable by the math verifier, knobs respected."""

from __future__ import annotations

import ast
import json
import operator

import pytest

from mindspeed_rl.data import DEMO_TEST, DEMO_TRAIN, generate_arithmetic, load_prompts, regenerate_demo
from mindspeed_rl.data.arithmetic import PRODUCTS_TEST, PRODUCTS_TRAIN, regenerate_products
from mindspeed_rl.rewards import MathVerifier

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _python_value(expression: str) -> int:
    """The expression's value by Python's own parser (an independent evaluator)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant)
        return node.value

    return walk(ast.parse(expression, mode="eval").body)


def test_shipped_files_are_what_the_generator_writes(tmp_path) -> None:
    train, test = regenerate_demo(tmp_path)
    assert train.read_bytes() == DEMO_TRAIN.read_bytes()
    assert test.read_bytes() == DEMO_TEST.read_bytes()
    train_q = {json.loads(line)["question"] for line in DEMO_TRAIN.read_text().splitlines()}
    test_q = {json.loads(line)["question"] for line in DEMO_TEST.read_text().splitlines()}
    assert len(train_q) == 512 and len(test_q) == 64 and not train_q & test_q
    # The tool demo's products (demo-products, demo-products-test).
    train, test = regenerate_products(tmp_path)
    assert train.read_bytes() == PRODUCTS_TRAIN.read_bytes() and test.read_bytes() == PRODUCTS_TEST.read_bytes()
    records = load_prompts("demo-products") + load_prompts("demo-products-test")
    assert len({r.prompt for r in records}) == 576
    for record in records:
        expression = record.prompt.removeprefix("What is ").removesuffix("?")
        assert " * " in expression and record.reference.endswith(f"#### {_python_value(expression)}")


def test_verifier_accepts_every_reference_and_rejects_wrong_answers() -> None:
    verifier = MathVerifier()
    for path in (DEMO_TRAIN, DEMO_TEST):
        for record in load_prompts(path):
            expression = record.prompt.removeprefix("What is ").removesuffix("?")
            value = _python_value(expression)
            assert record.reference.endswith(f"#### {value}")
            assert verifier(record.prompt, f"{expression} = {value}. The answer is {value}.", record.reference) == 1.0
            assert verifier(record.prompt, rf"\boxed{{{value}}}", record.reference) == 1.0
            assert verifier(record.prompt, f"#### {value + 1}", record.reference) == 0.0
            assert verifier(record.prompt, f"The answer is {value - 1}", record.reference) == 0.0
            assert verifier(record.prompt, "I do not know", record.reference) == 0.0


def test_knobs_and_determinism() -> None:
    records = generate_arithmetic(
        200, seed=3, min_operand=5, max_operand=9, operators=("*", "-"), num_operands=3, negative_results=True
    )
    assert records == generate_arithmetic(
        200, seed=3, min_operand=5, max_operand=9, operators=("*", "-"), num_operands=3, negative_results=True
    )
    assert records != generate_arithmetic(
        200, seed=4, min_operand=5, max_operand=9, operators=("*", "-"), num_operands=3, negative_results=True
    )
    assert len({r["question"] for r in records}) == 200
    values = []
    for r in records:
        expression = r["question"].removeprefix("What is ").removesuffix("?")
        tokens = expression.split()
        assert len(tokens) == 5 and set(tokens[1::2]) <= {"*", "-"}
        assert all(5 <= int(t) <= 9 for t in tokens[::2])
        value = _python_value(expression)
        assert r["answer"] == f"{expression} = {value}\n#### {value}"
        values.append(value)
    assert min(values) < 0  # negative results allowed here
    positive = generate_arithmetic(100, seed=0, operators=("-",))
    assert all(int(r["answer"].split("#### ")[1]) >= 0 for r in positive)


def test_bad_knobs() -> None:
    with pytest.raises(ValueError, match="subset of"):
        generate_arithmetic(3, operators=("/",))
    with pytest.raises(ValueError, match="distinct problems"):
        generate_arithmetic(50, min_operand=0, max_operand=2, operators=("+",))
    assert len(generate_arithmetic(50, min_operand=0, max_operand=2, operators=("+",), unique=False)) == 50
