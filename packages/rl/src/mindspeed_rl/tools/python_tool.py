"""The ``python`` tool: the model's code runs in :mod:`mindspeed_rl.tools.sandbox`; what it prints is the answer."""

from __future__ import annotations

import signal
from typing import Any

from mindspeed_rl.tools.base import TOOLS, Tool, ToolError
from mindspeed_rl.tools.sandbox import SandboxLimits, SandboxResult, capture_bytes, run_python

NETWORK_REFUSED = 126  # the bootstrap's exit status when isolation is required and none could be made


def describe(result: SandboxResult, limits: SandboxLimits) -> str:
    """The text the model sees; raises :class:`ToolError` with that text for a failed run."""
    text = result.output if result.output else "(no output)"
    if result.truncated:
        text += f"\n[output truncated to its first and last {limits.max_output_bytes // 2} bytes]"
    if result.overflowed:
        text += f"\n[the program wrote {capture_bytes(limits)} bytes, the most allowed; its later writes failed]"
    killed = result.returncode is not None and result.returncode < 0
    if result.timed_out:
        raise ToolError(f"{text}\n[error: timed out after {limits.wall_timeout_s:g} s; killed]", "timeout")
    if killed and -result.returncode == signal.SIGXCPU:
        raise ToolError(f"{text}\n[error: CPU time limit of {limits.cpu_seconds} s exceeded; killed]", "cpu_limit")
    if killed:  # SIGKILL here: the CPU limit's hard stop (SIGXCPU ignored) or the kernel's OOM killer
        raise ToolError(f"{text}\n[error: killed by {_signal_name(-result.returncode)}]", "killed")
    if result.returncode == NETWORK_REFUSED and limits.require_network_isolation and not result.network_isolated:
        raise ToolError("error: the sandbox could not isolate the network here, and isolation is required", "sandbox")
    if result.returncode != 0:
        kind = "output_limit" if result.overflowed else "exit_status"
        raise ToolError(f"{text}\n[exit status {result.returncode}]", kind)
    return text


def build_python(**limits: Any) -> Tool:
    """The ``python`` tool; ``limits`` are :class:`SandboxLimits` fields."""
    settings = SandboxLimits(**limits)
    return Tool(
        name="python",
        description=(
            "Run a Python program in a sandbox and return what it prints (stdout and stderr). "
            f"Limits: {settings.wall_timeout_s:g} s, {settings.memory_mb} MiB, "
            f"{settings.max_output_bytes} bytes of output; no network; standard library only."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print the result"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        execute=lambda arguments: describe(run_python(arguments["code"], settings), settings),
    )


TOOLS.register("python", build_python)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
