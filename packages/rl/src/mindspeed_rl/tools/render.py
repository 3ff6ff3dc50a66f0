"""Tool results as the chat template renders them, and a Qwen2.5-style template that handles tools.

The agent loop appends, after the model's turn that ended in tool calls, exactly the text the
tokenizer's chat template renders for the ``{"role": "tool", "content": ...}`` messages plus the
next assistant header: :func:`render_continuation` renders the conversation with and without
them and returns the difference, so any tools-capable template works (Qwen2.5's wraps each
result in ``<tool_response>`` inside one user turn). :data:`QWEN25_TOOLS_TEMPLATE` is that
template (Qwen2.5-Instruct's, with a shorter default system prompt) for tokenizers built in code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mindspeed_rl.tools.base import Tool, ToolResult

QWEN25_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) '
    'or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: The special tokens the template uses (a tokenizer built in code adds them).
QWEN25_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")


def tool_messages(results: Sequence[ToolResult]) -> list[dict[str, str]]:
    """One ``{"role": "tool", "content": ...}`` message per result, in order."""
    return [{"role": "tool", "content": result.content} for result in results]


def tool_schemas(tools: Mapping[str, Tool] | Sequence[Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` argument of ``apply_chat_template``."""
    return [tool.schema for tool in (tools.values() if isinstance(tools, Mapping) else tools)]


def render_continuation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    new_messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text the template adds for ``new_messages`` after ``messages``, with the next assistant header.

    ``messages`` ends with the assistant turn that made the calls.

    Raises:
        ValueError: the template does not render the longer conversation as an extension of the
            shorter one (the agent loop cannot append to the context then; use another template).
    """
    before = tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*messages, *new_messages], tools=tools, tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ValueError(
            "the tokenizer's chat template renders a conversation with tool results differently from its "
            "start, so tool responses cannot be appended: use a template whose turns only extend the text "
            "(e.g. mindspeed_rl.tools.QWEN25_TOOLS_TEMPLATE)"
        )
    return after[len(before) :]
