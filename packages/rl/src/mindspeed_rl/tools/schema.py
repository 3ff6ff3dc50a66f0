"""A validator for the JSON-schema subset tool arguments use.

``type`` (object, string, number, integer, boolean, array, null, or a list of them),
``properties``, ``required``, ``additionalProperties: false``, ``enum`` and array ``items``.
Anything else in a schema is ignored. It returns the problems as text for the model to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def validate_arguments(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> list[str]:
    """The ways ``value`` breaks ``schema`` (empty when it fits), each naming the path."""
    problems: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_TYPES.get(kind, lambda v: False)(value) for kind in kinds):
            return [f"{where} must be {' or '.join(kinds)}, got {_type_name(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {list(schema['enum'])}, got {value!r}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{where}.{key} is required")
        for key, item in value.items():
            if key in properties:
                problems.extend(validate_arguments(item, properties[key], f"{where}.{key}"))
            elif schema.get("additionalProperties", True) is False:
                problems.append(f"{where}.{key} is not a parameter (known: {', '.join(properties) or 'none'})")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            problems.extend(validate_arguments(item, schema["items"], f"{where}[{i}]"))
    return problems


def _type_name(value: Any) -> str:
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _TYPES[kind](value):
            return kind
    return type(value).__name__
