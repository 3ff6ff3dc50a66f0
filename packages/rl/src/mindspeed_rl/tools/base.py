"""Tools a policy may call: the :class:`Tool` contract, the registry, and one call that never raises.

A tool is a name, a JSON schema of its arguments (the OpenAI/transformers function format, so
``[tool.schema for tool in tools]`` is what ``tokenizer.apply_chat_template(..., tools=...)``
takes) and an execute function from the parsed arguments to the text the model sees. Tools are
registered in :data:`TOOLS` as factories (``TOOLS.get("python")(wall_timeout_s=5)``), as the
reward verifiers are. :func:`call_tool` validates the arguments and runs the tool; every failure
(bad arguments, a limit hit, an exception of the tool) comes back as the result's text, so the
model reads it and the rollout goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mindspeed.registry import Registry
from mindspeed_rl.tools.schema import validate_arguments


class ToolError(Exception):
    """A failure a tool reports to the model: ``kind`` for the metrics, the message as its text."""

    def __init__(self, message: str, kind: str = "tool_error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Tool:
    """One callable tool.

    Attributes:
        name: the function name the model writes in ``<tool_call>``.
        description: what it does (rendered into the prompt).
        parameters: the JSON schema of its arguments (``{"type": "object", "properties": ...}``).
        execute: parsed arguments -> the text the model sees; raises :class:`ToolError` to report
            a failure (any other exception is caught by :func:`call_tool` too).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    execute: Callable[[dict[str, Any]], str] = field(repr=False)

    @property
    def schema(self) -> dict[str, Any]:
        """The function schema as ``apply_chat_template(tools=[...])`` and OpenAI take it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True)
class ToolResult:
    """What one call gave.

    Attributes:
        name: the tool called (as written by the model; may be unknown).
        content: the text the model sees (the output, or the error).
        ok: False for every failure.
        error: the failure's kind (``malformed_call``, ``unknown_tool``, ``bad_arguments``,
            ``timeout``, ``cpu_limit``, ``exit_status``, ``exception``, ...) or None.
        elapsed_s: wall seconds of the call.
    """

    name: str
    content: str
    ok: bool = True
    error: str | None = None
    elapsed_s: float = 0.0


#: name -> factory(**options) -> Tool.
TOOLS: Registry[Callable[..., Tool]] = Registry("tool")


def build_tools(
    names: list[str] | tuple[str, ...], options: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Tool]:
    """The tools ``names`` built with their ``options`` (name -> keyword arguments), by name.

    Raises:
        ValueError: an unknown tool (listing the known ones) or an option it does not take.
    """
    options = options or {}
    unknown = set(options) - set(names)
    if unknown:
        raise ValueError(f"tool options for {sorted(unknown)}, which are not among the tools {list(names)}: drop them")
    tools = {}
    for name in names:
        factory = TOOLS.get(name)
        try:
            tool = factory(**dict(options.get(name, {})))
        except TypeError as err:
            raise ValueError(f"tool {name!r}: {err}") from err
        tools[tool.name] = tool
    return tools


def call_tool(tool: Tool | None, name: str, arguments: Any) -> ToolResult:
    """Validate ``arguments`` against ``tool``'s schema and run it; never raises (but BaseException).

    ``tool`` None means the model named a tool that is not offered.
    """
    start = time.perf_counter()

    def result(content: str, error: str | None = None) -> ToolResult:
        return ToolResult(name, content, error is None, error, time.perf_counter() - start)

    if tool is None:
        return result(f"error: unknown tool {name!r}", "unknown_tool")
    problems = validate_arguments(arguments, tool.parameters)
    if problems:
        return result(f"error: bad arguments for {name!r}: " + "; ".join(problems), "bad_arguments")
    try:
        return result(str(tool.execute(dict(arguments))))
    except ToolError as err:
        return result(str(err), err.kind)
    except Exception as err:  # a tool's bug is the model's error message, not the rollout's crash
        return result(f"error: {name!r} failed: {type(err).__name__}: {err}", "exception")
