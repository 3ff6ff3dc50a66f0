"""Tool results render as the chat template renders ``{"role": "tool"}`` messages, and the parser reads the
calls the template writes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mindspeed_rl.tools import (
    QWEN25_SPECIAL_TOKENS,
    QWEN25_TOOLS_TEMPLATE,
    ToolResult,
    build_tools,
    parse_tool_calls,
    render_continuation,
    tool_messages,
    tool_schemas,
)


def byte_tokenizer(chat_template: str) -> Any:
    """A byte-level tokenizer with the template's special tokens, built in code (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN25_SPECIAL_TOKENS)})
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_tokenizer(QWEN25_TOOLS_TEMPLATE)


def test_tool_messages_render_as_the_template_does(tokenizer: Any) -> None:
    tools = tool_schemas(build_tools(["calculator", "python"]))
    generated = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 59"}}\n</tool_call>'
    )
    messages = [{"role": "user", "content": "What is 37 * 59?"}, {"role": "assistant", "content": generated}]
    prompt = tokenizer.apply_chat_template(messages[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "\n" + json.dumps(tools[0]) + "\n" in prompt, "each tool's schema is one JSON line in <tools>"
    assert prompt.endswith("<|im_start|>user\nWhat is 37 * 59?<|im_end|>\n<|im_start|>assistant\n")

    results = [ToolResult("calculator", "2183"), ToolResult("python", "error: x\n[exit status 1]", False, "exit")]
    continuation = render_continuation(tokenizer, messages, tool_messages(results), tools)
    assert continuation == (
        "<|im_start|>user\n<tool_response>\n2183\n</tool_response>\n<tool_response>\nerror: x\n[exit status 1]\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ), "the results of one turn share one user turn, each in <tool_response>, then the assistant header"
    ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == continuation
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>"), "special tokens are single tokens"

    # Parse the generated turn only: the system prompt's format text holds two (malformed) calls.
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    *in_prompt, call = parse_tool_calls(rendered)
    assert len(in_prompt) == 2 and all("not JSON" in (example.error or "") for example in in_prompt)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "37 * 59"}, None)
    assert parse_tool_calls(generated) == [call]


def test_the_parser_reads_what_the_template_writes(tokenizer: Any) -> None:
    calls = [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "print({'a': '}'})"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2**10"}}},
    ]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)  # no tools=: no format example in the prompt
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in parsed] == [
        (call["function"]["name"], call["function"]["arguments"], None) for call in calls
    ]


def test_a_template_that_rewrites_history_is_refused() -> None:
    # A template that renders only the last message cannot be extended turn by turn.
    last_only = "{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}"
    tokenizer = byte_tokenizer(last_only)
    with pytest.raises(ValueError, match="cannot be appended"):
        render_continuation(tokenizer, [{"role": "assistant", "content": "a"}], [{"role": "tool", "content": "b"}])
