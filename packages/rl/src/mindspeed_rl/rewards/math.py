"""The ``math`` rule verifier: extract a final answer and compare it with the reference by value.

Extraction, in order: the last ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces are matched),
the text after the last ``####`` (GSM8K's convention), and, unless ``strict``, the last number in
the response. Comparison: both sides as exact fractions when they are numbers (integers,
decimals, ``3/4``, ``\\frac{3}{4}``, thousands commas ``1,234``, signs, a trailing ``%`` or unit
word, ``$`` signs), else as normalised strings (spaces, ``\\left``/``\\right``, ``\\text{}``
removed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
_FRACTION_RE = re.compile(rf"^\(?({_NUMBER})\)?\s*/\s*\(?({_NUMBER})\)?$")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# A number in running text: digits with optional thousands commas, decimals, a fraction bar.
_TEXT_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-+]?\.\d+")
_WITH_UNITS_RE = re.compile(rf"^(?:[A-Za-z]\w*\s*=\s*)?({_NUMBER}|[-+]?\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?)"
                            r"(?:\s+[A-Za-z][A-Za-z\s.]*)?$")
_TEXT_COMMANDS_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_MINUS = "\u2212"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of ``\\boxed x``.

    Returns None when there is no box or its braces never close.
    """
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        # "\boxed 5": the box holds the next token
        match = re.match(r"\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    depth = 0
    for i, char in enumerate(stripped):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return stripped[1:i].strip()
    return None


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The final answer of a response: boxed, else after ``####``, else (not ``strict``) the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text[text.rindex("####") + 4:].strip()
        return tail.splitlines()[0].strip() if tail else None
    if strict:
        return None
    numbers = _TEXT_NUMBER_RE.findall(text.replace(_MINUS, "-"))
    return numbers[-1].strip() if numbers else None


def reference_answer(reference: str) -> str:
    """The answer part of a reference: after ``####`` (GSM8K), inside ``\\boxed{}``, or all of it."""
    if "####" in reference:
        return reference[reference.rindex("####") + 4:].strip()
    boxed = extract_boxed(reference)
    return boxed if boxed is not None else reference.strip()


def _strip_latex(text: str) -> str:
    text = text.replace(_MINUS, "-").replace("\\$", "").replace("$", "").replace("\\%", "%")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "\\(", "\\)", "\\[", "\\]", "~"):
        text = text.replace(token, "")
    previous = None
    while previous != text:  # unwrap nested \text{...} and \frac{..}{..} from the inside out
        previous = text
        text = _TEXT_COMMANDS_RE.sub(r"\1", text)
        text = _FRAC_RE.sub(r"(\1)/(\2)", text)
    return _FRAC_SHORT_RE.sub(r"\1/\2", text).strip()


def _to_fraction(text: str) -> Fraction | None:
    text = text.strip().rstrip(".").strip()
    if len(text) > 2 and (text[0], text[-1]) in (("(", ")"), ("{", "}")) and not any(c in text[1:-1] for c in "(){}"):
        text = text[1:-1].strip()  # "(3)", "{1,234}"; not "(1)/(2)"
    if _THOUSANDS_RE.match(text):
        text = text.replace(",", "")
    if _NUMBER_RE.match(text):
        return Fraction(text)
    match = _FRACTION_RE.match(text)
    if match:
        denominator = Fraction(match.group(2))
        return Fraction(match.group(1)) / denominator if denominator else None
    return None


def parse_number(text: str) -> Fraction | None:
    """The exact value of an answer string, or None if it is not (just) a number.

    Accepts ``42``, ``-3.50``, ``+7``, ``1,234``, ``3/4``, ``\\frac{3}{4}``, ``\\$18``, ``50%`` (the
    number before the sign: GSM8K answers percentages as bare numbers), ``1e3``, and a single
    number followed by a unit or a word (``18 dollars``, ``5 \\text{cm}``).
    """
    text = _strip_latex(text).rstrip(".").strip()
    text = text[:-1].strip() if text.endswith("%") else text
    value = _to_fraction(text)
    if value is not None:
        return value
    # "18 dollars", "x = 5": one number, an optional "name =" before it and unit words after it.
    match = _WITH_UNITS_RE.match(text)
    return _to_fraction(match.group(1)) if match else None


def normalize_answer(text: str) -> str:
    """A non-numeric answer reduced for string comparison (LaTeX spacing, ``\\text{}``, case)."""
    text = _strip_latex(text).rstrip(".")
    return re.sub(r"\s+", "", text).lower()


def answers_equal(prediction: str, reference: str, rel_tol: float = 1e-6) -> bool:
    """Whether two answer strings are the same answer (by value when both are numbers)."""
    a, b = parse_number(prediction), parse_number(reference)
    if a is not None and b is not None:
        return a == b or math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)
    return normalize_answer(prediction) == normalize_answer(reference)


@dataclass
class MathVerifier:
    """Reward 1 for a final answer equal to the reference's, else 0 (a :class:`RewardFunction`).

    Args:
        strict: only boxed or ``####`` answers count (no last-number fallback).
        correct: the reward of a correct answer.
        incorrect: the reward of a wrong or missing answer (DAPO uses -1).
    """

    strict: bool = False
    correct: float = 1.0
    incorrect: float = 0.0

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """Score ``response`` against ``reference`` (``prompt`` is unused).

        Raises:
            ValueError: if ``reference`` is None (the math verifier needs the answer).
        """
        if reference is None:
            raise ValueError("the math verifier needs a reference answer: set data.map_keys.reference to the answer field")
        answer = extract_answer(response, strict=self.strict)
        if answer is None:
            return self.incorrect
        return self.correct if answers_equal(answer, reference_answer(reference)) else self.incorrect
