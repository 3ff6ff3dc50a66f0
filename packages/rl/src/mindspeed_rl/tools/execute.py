"""Run a batch of parsed calls concurrently, each with a timeout, at most ``max_parallel`` at once.

The agent loop hands one batch per turn (the calls of every sample that stopped at a tool
call); the results come back in the calls' order. A call's timeout counts from its start, not
from the batch's: a queued call does not time out waiting. A tool running past it is reported as
a timeout at once; a sandboxed tool's own wall limit kills its process, an in-process tool (the
calculator) is bounded by construction, its thread finishes in the background.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from mindspeed_rl.tools.base import Tool, ToolResult, call_tool
from mindspeed_rl.tools.parse import ToolCall


def execute_call(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
    """One call's result; a malformed call's error is its result. Never raises."""
    if call.error is not None:
        kind = "malformed_call" if not call.name else "bad_arguments"
        return ToolResult(call.name, call.error, ok=False, error=kind)
    return call_tool(tools.get(call.name), call.name, call.arguments)


def execute_calls(
    calls: Sequence[ToolCall], tools: Mapping[str, Tool], max_parallel: int = 4, timeout_s: float = 30.0
) -> list[ToolResult]:
    """The results of ``calls`` in order, run on up to ``max_parallel`` threads. Never raises.

    Raises:
        ValueError: ``max_parallel`` or ``timeout_s`` not positive (a setting, not a model's call).
    """
    if max_parallel < 1 or not timeout_s > 0:
        raise ValueError(f"max_parallel={max_parallel}, timeout_s={timeout_s}: give positive values")
    if not calls:
        return []
    started: dict[int, float] = {}
    results: list[ToolResult | None] = [None] * len(calls)

    def run(i: int) -> ToolResult:
        started[i] = time.perf_counter()
        return execute_call(calls[i], tools)

    pool = ThreadPoolExecutor(max_workers=min(max_parallel, len(calls)), thread_name_prefix="tool")
    try:
        pending: dict[Future[ToolResult], int] = {pool.submit(run, i): i for i in range(len(calls))}
        while pending:
            done, _ = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    results[i] = future.result()
                except Exception as err:  # execute_call catches everything; this is a last guard
                    results[i] = ToolResult(calls[i].name, f"error: {type(err).__name__}: {err}", False, "exception")
            now = time.perf_counter()
            for future, i in list(pending.items()):
                if i in started and now - started[i] > timeout_s:
                    pending.pop(future)
                    future.cancel()
                    results[i] = ToolResult(
                        calls[i].name, f"error: timed out after {timeout_s:g} s", False, "timeout", now - started[i]
                    )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [result for result in results if result is not None]
