"""Hermes/Qwen tool calls are parsed strictly, and every malformed call is a result, never an exception."""

from __future__ import annotations

import json
import random

from mindspeed_rl.tools import ToolCall, build_tools, execute_call, has_open_call, parse_tool_calls, validate_arguments


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def test_good_calls_several_per_text_and_braces_in_strings() -> None:
    code = "d = {'a': {'b': '}}</tool'}}\nprint(d)"
    text = (
        "I will compute.\n"
        + block('{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}')
        + "\nand\n"
        + block(json.dumps({"name": "python", "arguments": {"code": code}}))
        + block('{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}')
    )
    calls = parse_tool_calls(text)
    assert calls == [
        ToolCall("calculator", {"expression": "12 * (3 + 4)"}, text=calls[0].text),
        ToolCall("python", {"code": code}, text=calls[1].text),
        ToolCall("calculator", {"expression": "1+1"}, text=calls[2].text),
    ]
    assert all(call.error is None for call in calls)
    tools = build_tools(["calculator"])
    assert execute_call(calls[0], tools).content == "84"
    assert execute_call(calls[2], tools).content == "2"
    assert parse_tool_calls('no calls here {"name": "calculator"}') == []
    assert not has_open_call(text) and has_open_call(text + '<tool_call>\n{"name": "calc')


def test_malformed_calls_become_errors_the_model_reads() -> None:
    tools = build_tools(["calculator"])
    cases = {
        block('{"name": "calculator", "arguments": {"expression": "1+1"}'): ("malformed_call", "not JSON"),
        block("[1, 2]"): ("malformed_call", "a JSON list, not an object"),
        block('{"name": "calculator", "arguments": {}, "id": 3}'): ("malformed_call", "unexpected keys ['id']"),
        block('{"arguments": {"expression": "1"}}'): ("malformed_call", '"name" must be a non-empty string'),
        block('{"name": "calculator", "arguments": {"expression": NaN}}'): ("malformed_call", "NaN is not JSON"),
        block('{"name": "calculator", "arguments": "{oops"}'): ("bad_arguments", "are not JSON"),
        block('{"name": "calculator", "arguments": [1]}'): ("bad_arguments", "must be a JSON object"),
        block('{"name": "shell", "arguments": {"cmd": "rm -rf /"}}'): ("unknown_tool", "unknown tool 'shell'"),
        block('{"name": "calculator", "arguments": {"expression": 12}}'): (
            "bad_arguments",
            "arguments.expression must be string, got integer",
        ),
        block('{"name": "calculator", "arguments": {}}'): ("bad_arguments", "arguments.expression is required"),
        block('{"name": "calculator", "arguments": {"expression": "1", "x": 1}}'): (
            "bad_arguments",
            "arguments.x is not a parameter (known: expression)",
        ),
        block('{"name": "calculator", "arguments": {"expression": "os.system(1)"}}'): (
            "bad_arguments",
            "a function call",
        ),
        '<tool_call>\n{"name": "calculator", "arguments": {"expr': ("malformed_call", "never closed"),
    }
    for text, (kind, words) in cases.items():
        (call,) = parse_tool_calls(text)
        result = execute_call(call, tools)
        assert not result.ok and result.error == kind and words in result.content, (text, result)
        assert result.content.startswith("error:"), result


def test_random_text_never_raises() -> None:
    rng = random.Random(2)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"calculator"', "[", "]"]
    pieces += ['"', "\\", "1", "NaN", "null", "true", " ", "\n", "\x00", '"expression"', '"2+2"', "\ud800"]
    tools = build_tools(["calculator"])
    seen = set()
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        for call in parse_tool_calls(text):
            seen.add(execute_call(call, tools).error)
    assert "malformed_call" in seen, seen


def test_schema_subset() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"type": "string", "enum": ["fast", "exact"]},
            "maybe": {"type": ["string", "null"]},
        },
        "required": ["n"],
    }
    assert (
        validate_arguments({"n": 1, "x": 1.5, "flag": True, "tags": ["a"], "mode": "fast", "maybe": None}, schema) == []
    )
    assert validate_arguments({"n": 2, "x": 3}, schema) == [], "an integer is a number"
    assert validate_arguments({"n": True}, schema) == ["arguments.n must be integer, got boolean"]
    assert validate_arguments({"n": 1.0}, schema) == ["arguments.n must be integer, got number"]
    assert validate_arguments({"n": 1, "x": "1"}, schema) == ["arguments.x must be number, got string"]
    assert validate_arguments({"n": 1, "flag": 1}, schema) == ["arguments.flag must be boolean, got integer"]
    assert validate_arguments({"n": 1, "tags": ["a", 2]}, schema) == ["arguments.tags[1] must be string, got integer"]
    assert validate_arguments({"n": 1, "mode": "slow"}, schema) == [
        "arguments.mode must be one of ['fast', 'exact'], got 'slow'"
    ]
    assert validate_arguments([], schema) == ["arguments must be object, got array"]
    assert validate_arguments({}, schema) == ["arguments.n is required"]
