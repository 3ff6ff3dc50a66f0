"""Run a batch of parsed calls concurrently, each with a timeout, at most ``max_parallel`` at once.

:func:`execute_calls` runs one batch and returns its results in the calls' order;
:class:`ToolExecutor` keeps a pool open and takes batches while the caller goes on (the agent
loop's overlapped mode submits each sample's calls as its turn closes). A call's timeout counts from its start, not
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
    if not calls:
        ToolExecutor.check(max_parallel, timeout_s)
        return []
    with ToolExecutor(tools, min(max_parallel, len(calls)), timeout_s) as executor:
        executor.submit(calls)
        while True:
            for _, results in executor.poll(wait_s=0.05):
                return results


class ToolExecutor:
    """Batches of calls run on one thread pool while the caller goes on; finished batches are polled.

    The agent loop submits each sample's calls as soon as its turn closes and polls between the
    engine's steps (:meth:`poll` with ``wait_s=0`` does not block), so tools run while the other
    samples decode. A call's timeout counts from its own start; a call past it is reported as a
    timeout at once (its thread finishes in the background; a sandboxed program is killed by its
    own wall limit). Never raises on a call.

    Args:
        tools: the tools by name.
        max_parallel: calls run at once (threads).
        timeout_s: wall seconds per call.
    """

    def __init__(self, tools: Mapping[str, Tool], max_parallel: int = 4, timeout_s: float = 30.0) -> None:
        self.check(max_parallel, timeout_s)
        self.tools, self.timeout_s = tools, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="tool")
        self._pending: dict[Future[ToolResult], tuple[int, int]] = {}
        self._calls: dict[int, Sequence[ToolCall]] = {}
        self._results: dict[int, list[ToolResult | None]] = {}
        self._started: dict[tuple[int, int], float] = {}
        self._batches = 0

    @staticmethod
    def check(max_parallel: int, timeout_s: float) -> None:
        """Raises ValueError on a ``max_parallel`` or ``timeout_s`` that is not positive."""
        if max_parallel < 1 or not timeout_s > 0:
            raise ValueError(f"max_parallel={max_parallel}, timeout_s={timeout_s}: give positive values")

    @property
    def busy(self) -> bool:
        """Whether a submitted batch has not been returned by :meth:`poll` yet."""
        return bool(self._results)

    def submit(self, calls: Sequence[ToolCall]) -> int:
        """Start a batch of calls; returns its id (0, 1, ... in order). An empty batch is done at once."""
        batch = self._batches
        self._batches += 1
        self._calls[batch] = calls
        self._results[batch] = [None] * len(calls)
        for k in range(len(calls)):
            self._pending[self._pool.submit(self._run, batch, k)] = (batch, k)
        return batch

    def poll(self, wait_s: float = 0.0) -> list[tuple[int, list[ToolResult]]]:
        """The batches finished since the last poll, as ``(id, results in the calls' order)``.

        Args:
            wait_s: block up to this long for a call to finish when none has (0: do not block).
        """
        if self._pending:
            done, _ = wait(self._pending, timeout=wait_s, return_when=FIRST_COMPLETED)
            for future in done:
                batch, k = self._pending.pop(future)
                self._started.pop((batch, k), None)
                try:
                    self._results[batch][k] = future.result()
                except Exception as err:  # execute_call catches everything; this is a last guard
                    call = self._calls[batch][k]
                    self._results[batch][k] = ToolResult(
                        call.name, f"error: {type(err).__name__}: {err}", False, "exception"
                    )
            now = time.perf_counter()
            for future, (batch, k) in list(self._pending.items()):
                begun = self._started.get((batch, k))
                if begun is not None and now - begun > self.timeout_s:
                    self._pending.pop(future)
                    self._started.pop((batch, k), None)
                    future.cancel()
                    self._results[batch][k] = ToolResult(
                        self._calls[batch][k].name,
                        f"error: timed out after {self.timeout_s:g} s",
                        False,
                        "timeout",
                        now - begun,
                    )
        finished = [batch for batch, results in self._results.items() if all(r is not None for r in results)]
        out = []
        for batch in finished:
            out.append((batch, [r for r in self._results.pop(batch) if r is not None]))
            del self._calls[batch]
        return out

    def close(self) -> None:
        """Stop taking calls; queued ones are cancelled, running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, batch: int, k: int) -> ToolResult:
        call = self._calls[batch][k]  # read before the start is visible: a timed-out batch is dropped
        self._started[(batch, k)] = time.perf_counter()
        return execute_call(call, self.tools)
