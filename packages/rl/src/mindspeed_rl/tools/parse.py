"""Strict parsing of Hermes/Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Each block between the markers is read with :func:`json.loads` only (``NaN``/``Infinity``
refused). A block that is not one JSON object with a string ``name`` and an object
``arguments`` (or a string holding one, as OpenAI-style models write it), and no other key,
becomes a :class:`ToolCall` with ``error`` set: the executor turns it into a message the model
sees. An opening marker that never closes is a malformed call too (the generation stopped in
the middle of it). Text between the markers may hold any braces: the markers, not the braces,
delimit a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``error`` None for a well-formed one (its tool may still be unknown)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    text: str = ""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order; never raises."""
    calls = []
    for match in _BLOCK.finditer(text):
        body, closed = match.group(1), match.group(0).endswith(CLOSE)
        calls.append(_parse_block(body) if closed else _malformed(body, f"{OPEN} is never closed by {CLOSE}"))
    return calls


def has_open_call(text: str) -> bool:
    """Whether ``text`` ends inside a ``<tool_call>`` block (the generation should go on to its end)."""
    return text.rfind(OPEN) > text.rfind(CLOSE)


def _malformed(body: str, why: str) -> ToolCall:
    return ToolCall(
        name="",
        error=f"error: malformed tool call ({why}); write {OPEN}" + '{"name": ..., "arguments": {...}}' + CLOSE,
        text=body,
    )


def _parse_block(body: str) -> ToolCall:
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        return _malformed(body, f"not JSON: {err}")
    if not isinstance(value, dict):
        return _malformed(body, f"a JSON {type(value).__name__}, not an object")
    extra = sorted(set(value) - {"name", "arguments"})
    if extra:
        return _malformed(body, f"unexpected keys {extra}")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return _malformed(body, '"name" must be a non-empty string')
    if isinstance(arguments, str):  # OpenAI-style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError) as err:
            return ToolCall(name=name, error=f"error: the arguments of {name!r} are not JSON: {err}", text=body)
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'error: "arguments" of {name!r} must be a JSON object', text=body)
    return ToolCall(name=name, arguments=arguments, text=body)
