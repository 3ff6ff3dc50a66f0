"""Tools for multi-turn rollouts: a registry, the calculator and sandboxed Python, call parsing and execution.

:data:`TOOLS` holds tool factories by name (``calculator``, ``python``; register more);
:func:`parse_tool_calls` reads the Hermes/Qwen ``<tool_call>`` blocks of a generation strictly;
:func:`execute_calls` runs a batch of them concurrently; :func:`render_continuation` gives the
text a chat template adds for their results. Nothing here raises on a model's output: every
malformed call, unknown tool, bad argument, limit or exception is a result the model reads.
"""

from __future__ import annotations

from mindspeed_rl.tools.base import TOOLS, Tool, ToolError, ToolResult, build_tools, call_tool
from mindspeed_rl.tools.calculator import build_calculator, evaluate
from mindspeed_rl.tools.execute import ToolExecutor, execute_call, execute_calls
from mindspeed_rl.tools.parse import ToolCall, has_open_call, parse_tool_calls
from mindspeed_rl.tools.python_tool import build_python
from mindspeed_rl.tools.render import (
    QWEN25_SPECIAL_TOKENS,
    QWEN25_TOOLS_TEMPLATE,
    render_continuation,
    tool_messages,
    tool_schemas,
)
from mindspeed_rl.tools.sandbox import SandboxLimits, SandboxResult, run_python
from mindspeed_rl.tools.schema import validate_arguments

__all__ = [
    "QWEN25_SPECIAL_TOKENS",
    "QWEN25_TOOLS_TEMPLATE",
    "TOOLS",
    "SandboxLimits",
    "SandboxResult",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "build_calculator",
    "build_python",
    "build_tools",
    "call_tool",
    "evaluate",
    "execute_call",
    "execute_calls",
    "ToolExecutor",
    "has_open_call",
    "parse_tool_calls",
    "render_continuation",
    "run_python",
    "tool_messages",
    "tool_schemas",
    "validate_arguments",
]
