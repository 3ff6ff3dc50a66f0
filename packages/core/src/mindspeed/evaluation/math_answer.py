"""The one math-answer grader: ``mindspeed-llm evaluate --task gsm8k`` and the RL ``math`` reward use it.

A policy trained by ``mindspeed-rl`` is scored by the same rules in ``mindspeed-llm evaluate``.
The rules follow the graders GSM8K and MATH numbers are published with:

**Extraction** (:func:`extract_answer`), first rule that finds something wins:

1. the **last** ``\\boxed{...}`` / ``\\fbox{...}`` (braces matched) or ``\\boxed x``: the MATH
   convention (lm-evaluation-harness ``minerva_math``, Qwen2.5-Math's evaluator);
2. the **first** ``#### <number>``: lm-evaluation-harness GSM8K ``strict-match`` (the regex
   ``#### (-?[0-9.,]+)`` and its first match). GSM8K solutions end with one ``####`` line, so
   what a model writes after its first one is past its answer. The answer is the rest of that
   line (up to another ``####``) when it is one number (``1/2``, ``18 dollars``), else the
   first number in it;
3. unless ``strict``: the **last** number in the text (lm-evaluation-harness
   ``flexible-extract``, Qwen2.5-Math's last-number fallback). A minus sign counts only when
   it is not a dash between two words or numbers (``3-4`` is 3 and 4); a Unicode minus counts.

The **reference** is its first ``#### <number>`` answer (GSM8K's ``answer`` field), else its
last box, else the whole string.

**Equivalence** (:func:`answers_equal`): both sides as exact fractions when they are numbers
(integers, decimals, ``3/4``, ``\\frac{3}{4}``, thousands commas ``1,234``, signs, a trailing
``%`` or unit word, ``$`` signs), within a relative 1e-6; else as normalised strings (spaces,
``\\left``/``\\right``, ``\\text{}`` and case removed).

Everything is linear-time string scanning (no backtracking-prone regular expressions), so no
per-sample timeout is needed.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MARKER = "####"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
_FRACTION_RE = re.compile(rf"^\(?({_NUMBER})\)?\s*/\s*\(?({_NUMBER})\)?$")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# A number in running text: a sign unless it joins two words or numbers (the dash of "3-4"),
# digits with optional thousands commas ("1,234", not "1,2"), decimals, a fraction bar; ".5" too.
_TEXT_NUMBER_RE = re.compile(
    r"(?:(?<![\w.])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|\.\d+)"
)
_WITH_UNITS_RE = re.compile(
    rf"^(?:[A-Za-z]\w*\s*=\s*)?({_NUMBER}|[-+]?\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?)"
    r"(?:\s+[A-Za-z][A-Za-z\s.]*)?$"
)
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
    rest = text[start + len(command) :]
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


def extract_marked(text: str) -> str | None:
    """The answer of the first ``#### <number>``: the rest of its line if one number, else its first number.

    ``"#### 5 ... #### 7"`` gives ``"5"``, ``"#### 1/2"`` gives ``"1/2"``, ``"#### 18 dollars"``
    gives ``"18 dollars"``; a ``####`` followed by no number on its line is skipped.
    """
    text = text.replace(_MINUS, "-")
    for segment in text.split(MARKER)[1:]:
        line = segment.strip().split("\n", 1)[0].strip()
        if parse_number(line) is not None:
            return line
        found = _TEXT_NUMBER_RE.search(line)
        if found:
            return found.group().strip()
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in running text (``-12``, ``1,234``, ``3/4``, ``.5``), or None."""
    numbers = _TEXT_NUMBER_RE.findall(text.replace(_MINUS, "-"))
    return numbers[-1].strip() if numbers else None


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The final answer of a response: the last box, else the first ``#### <number>``, else the last number.

    Args:
        text: a generated (or reference) solution.
        strict: only a box or a ``####`` answer counts (no last-number fallback).

    Returns:
        The answer text (compare it with :func:`answers_equal`), or None when there is none.
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    marked = extract_marked(text)
    if marked is not None or strict:
        return marked
    return extract_last_number(text)


def reference_answer(reference: str) -> str:
    """The answer part of a reference: its ``#### <number>`` (GSM8K), else its last box, else all of it."""
    marked = extract_marked(reference)
    if marked is not None:
        return marked
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


def grade_answer(response: str, reference: str, strict: bool = False) -> bool:
    """Whether ``response``'s final answer equals ``reference``'s (the rules of the module docstring)."""
    answer = extract_answer(response, strict=strict)
    return answer is not None and answers_equal(answer, reference_answer(reference))
