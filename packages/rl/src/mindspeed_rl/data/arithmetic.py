"""The embedded default data set: generated arithmetic problems in GSM8K's format.

Each record is ``{"question": "What is 17 + 5?", "answer": "17 + 5 = 22\\n#### 22"}``, so the
``math`` verifier checks answers exactly as it checks GSM8K. The generator is seeded and has
difficulty knobs (operand range, operators, operand count, negative results). The shipped
files (:data:`DEMO_TRAIN`, :data:`DEMO_TEST`) are what :func:`regenerate_demo` writes; a test
regenerates them and compares bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
DEMO_TRAIN = ASSETS_DIR / "arithmetic_train.jsonl"
DEMO_TEST = ASSETS_DIR / "arithmetic_test.jsonl"
#: The settings of the shipped files: sums and differences of 0..20 with non-negative results.
DEMO_SETTINGS: dict[str, Any] = dict(
    seed=0, min_operand=0, max_operand=20, operators=("+", "-"), num_operands=2, negative_results=False
)
DEMO_SIZES = (512, 64)
#: The tool demo's products of two two-digit numbers (``demo-products`` / ``demo-products-test``).
PRODUCTS_TRAIN = ASSETS_DIR / "products_train.jsonl"
PRODUCTS_TEST = ASSETS_DIR / "products_test.jsonl"
PRODUCTS_SETTINGS: dict[str, Any] = dict(
    seed=3, min_operand=10, max_operand=99, operators=("*",), num_operands=2, negative_results=False
)
OPERATORS = ("+", "-", "*")


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of ``a0 op0 a1 op1 a2 ...`` with the usual precedence (``*`` before ``+``/``-``)."""
    terms, signs = [operands[0]], []
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return terms[0] + sum(sign * term for sign, term in zip(signs, terms[1:]))


def _problem(
    rng: random.Random, low: int, high: int, operators: Sequence[str], count: int, negative_results: bool
) -> tuple[str, int]:
    while True:
        operands = [rng.randint(low, high) for _ in range(count)]
        ops = [rng.choice(operators) for _ in range(count - 1)]
        value = evaluate(operands, ops)
        if negative_results or value >= 0:
            expression = " ".join(str(operands[0]) if i == 0 else f"{ops[i - 1]} {operands[i]}" for i in range(count))
            return expression, value


def generate_arithmetic(
    num: int,
    seed: int = 0,
    min_operand: int = 0,
    max_operand: int = 20,
    operators: Sequence[str] = ("+", "-"),
    num_operands: int = 2,
    negative_results: bool = False,
    unique: bool = True,
) -> list[dict[str, str]]:
    """``num`` arithmetic problems in GSM8K's format.

    Args:
        num: number of records.
        seed: the random seed (same arguments, same records).
        min_operand: smallest operand.
        max_operand: largest operand.
        operators: drawn from ``+``, ``-``, ``*``.
        num_operands: operands per expression (2 or more).
        negative_results: allow a negative answer (else such expressions are redrawn).
        unique: no question twice (raises when the settings have too few distinct problems).

    Returns:
        Records ``{"question": ..., "answer": "<expression> = <value>\\n#### <value>"}``.

    Raises:
        ValueError: on bad knobs or when ``unique`` cannot be met.
    """
    if not operators or any(op not in OPERATORS for op in operators):
        raise ValueError(f"operators {list(operators)}: use a non-empty subset of {', '.join(OPERATORS)}")
    if num_operands < 2 or min_operand > max_operand or num < 0:
        raise ValueError(
            f"need num >= 0, num_operands >= 2 and min_operand <= max_operand "
            f"(got {num}, {num_operands}, {min_operand}..{max_operand})"
        )
    if not negative_results and min_operand < 0:
        raise ValueError(
            "negative operands with negative_results=False: set min_operand >= 0 or allow negative results"
        )
    rng = random.Random(seed)
    records, seen = [], set()
    attempts = 0
    while len(records) < num:
        expression, value = _problem(rng, min_operand, max_operand, operators, num_operands, negative_results)
        attempts += 1
        if unique and expression in seen:
            if attempts > 50 * (num + 10):
                raise ValueError(
                    f"only {len(records)} distinct problems found for {num} requested: widen the operand "
                    "range, add operators or operands, or pass unique=False"
                )
            continue
        seen.add(expression)
        records.append({"question": f"What is {expression}?", "answer": f"{expression} = {value}\n#### {value}"})
    return records


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write one JSON object per line, atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def regenerate_demo(out_dir: str | Path = ASSETS_DIR) -> tuple[Path, Path]:
    """Write the shipped train/test files (disjoint questions) into ``out_dir``; returns their paths."""
    train_size, test_size = DEMO_SIZES
    records = generate_arithmetic(train_size + test_size, **DEMO_SETTINGS)
    out_dir = Path(out_dir)
    return (
        write_jsonl(records[:train_size], out_dir / DEMO_TRAIN.name),
        write_jsonl(records[train_size:], out_dir / DEMO_TEST.name),
    )


def regenerate_products(out_dir: str | Path = ASSETS_DIR) -> tuple[Path, Path]:
    """Write the tool demo's shipped product files (disjoint questions) into ``out_dir``; returns their paths."""
    train_size, test_size = DEMO_SIZES
    records = generate_arithmetic(train_size + test_size, **PRODUCTS_SETTINGS)
    out_dir = Path(out_dir)
    return (
        write_jsonl(records[:train_size], out_dir / PRODUCTS_TRAIN.name),
        write_jsonl(records[train_size:], out_dir / PRODUCTS_TEST.name),
    )
