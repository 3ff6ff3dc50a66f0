"""Tools extend by registration; a batch runs concurrently within its limits; nothing raises."""

from __future__ import annotations

import threading
import time

import pytest

from mindspeed_rl.tools import TOOLS, Tool, ToolCall, ToolError, build_tools, call_tool, execute_calls, tool_schemas


def test_registry_builds_the_shipped_tools_and_refuses_unknown_ones() -> None:
    assert {"calculator", "python"} <= set(TOOLS)
    tools = build_tools(["calculator", "python"], {"python": {"wall_timeout_s": 3.0}})
    assert list(tools) == ["calculator", "python"]
    schema = tool_schemas(tools)[1]
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(ValueError, match="unknown tool 'calculater'. Did you mean 'calculator'"):
        build_tools(["calculater"])
    with pytest.raises(ValueError, match="tool 'python': .*wall_timeout"):
        build_tools(["python"], {"python": {"wall_timeout": 3}})
    with pytest.raises(ValueError, match="not among the tools"):
        build_tools(["calculator"], {"python": {}})
    with pytest.raises(ValueError, match="sandbox memory_mb=0"):
        build_tools(["python"], {"python": {"memory_mb": 0}})


def test_a_registered_tool_is_called_and_its_failures_are_results() -> None:
    def build_echo() -> Tool:
        def execute(arguments: dict) -> str:
            if arguments["text"] == "raise":
                raise RuntimeError("tool bug")
            if arguments["text"] == "refuse":
                raise ToolError("error: refused", "refused")
            return arguments["text"].upper()

        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        return Tool("echo", "Upper-case a text.", schema, execute)

    TOOLS.register("echo", build_echo)
    try:
        with pytest.raises(ValueError, match="already registered"):
            TOOLS.register("echo", build_echo)
        echo = build_tools(["echo"])["echo"]
        assert call_tool(echo, "echo", {"text": "hi"}).content == "HI"
        bug = call_tool(echo, "echo", {"text": "raise"})
        assert (bug.ok, bug.error, bug.content) == (False, "exception", "error: 'echo' failed: RuntimeError: tool bug")
        refused = call_tool(echo, "echo", {"text": "refuse"})
        assert (refused.ok, refused.error, refused.content) == (False, "refused", "error: refused")
    finally:
        TOOLS.unregister("echo")


def sleeper(active: list[int], peak: list[int], lock: threading.Lock) -> Tool:
    def execute(arguments: dict) -> str:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(arguments["seconds"])
        with lock:
            active[0] -= 1
        return f"slept {arguments['seconds']}"

    schema = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
    return Tool("sleep", "Sleep.", schema, execute)


def test_batches_run_concurrently_within_the_limit_and_in_order() -> None:
    active, peak, lock = [0], [0], threading.Lock()
    tools = {"sleep": sleeper(active, peak, lock)}
    calls = [ToolCall("sleep", {"seconds": 0.2}) for _ in range(6)]
    start = time.perf_counter()
    results = execute_calls(calls, tools, max_parallel=3, timeout_s=5.0)
    elapsed = time.perf_counter() - start
    assert [r.content for r in results] == ["slept 0.2"] * 6
    assert peak[0] == 3, "three at once, never more"
    assert 0.35 < elapsed < 3.0, "two waves of three, not six in a row"

    # A queued call's timeout counts from its own start: one at a time, each within its limit.
    peak[0] = 0
    results = execute_calls([ToolCall("sleep", {"seconds": 0.15})] * 3, tools, max_parallel=1, timeout_s=1.0)
    assert all(r.ok for r in results) and peak[0] == 1

    # One call past its timeout is reported as a timeout; the others and the order hold.
    mixed = [ToolCall("sleep", {"seconds": 0.05}), ToolCall("sleep", {"seconds": 2.0}), ToolCall("nope", {})]
    mixed.append(ToolCall("", error="error: malformed tool call (not JSON)"))
    start = time.perf_counter()
    results = execute_calls(mixed, tools, max_parallel=4, timeout_s=0.5)
    assert time.perf_counter() - start < 1.8
    assert [(r.ok, r.error) for r in results] == [(True, None), (False, "timeout"), (False, "unknown_tool")] + [
        (False, "malformed_call")
    ]
    assert results[1].content == "error: timed out after 0.5 s"
    assert execute_calls([], tools) == []
    with pytest.raises(ValueError, match="max_parallel=0"):
        execute_calls(mixed, tools, max_parallel=0)
