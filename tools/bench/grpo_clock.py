"""Step clocks shared by both sides of ``tools/bench/grpo.py``: wall, CPU and run-queue time.

Each side's child process marks the start of every step with :func:`now`; :func:`periods`
turns the marks into step periods; :func:`memory_status` adds peak memory, CPU affinity and the
busiest threads; :class:`Profiler` records a CPU-time cProfile of the timed steps on request.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path

#: Model shapes of ``--size`` of the grpo and ppo benches (vocabulary 2048: the demo tokenizer's).
SIZES = {
    "tiny": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "micro": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def memory_status() -> dict[str, float]:
    """:func:`_child.memory_status` plus CPU affinity, nice and per-thread CPU seconds."""
    return {
        **_child.memory_status(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.nice(0),
        "thread_cpu_s": thread_cpu(),
    }


def thread_cpu() -> list[tuple[str, float]]:
    """CPU seconds of this process's busiest threads (name, user + system), busiest first."""
    tick, out = os.sysconf("SC_CLK_TCK"), []
    for task in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{task}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out.append((name, (int(fields[11]) + int(fields[12])) / tick))
    return sorted(out, key=lambda item: -item[1])[:4]


def now() -> tuple[float, float, float]:
    """Wall clock, process CPU time, and the calling thread's run-queue wait (Linux; else 0)."""
    try:
        wait = int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        wait = 0.0
    return time.perf_counter(), time.process_time(), wait


class Profiler:
    """A CPU-time cProfile of the timed steps when ``spec["profile"]`` is set (else does nothing)."""

    def __init__(self, spec: dict[str, Any], side: str) -> None:
        import cProfile

        self.path = Path(spec["workdir"]) / f"profile_{side}" if spec.get("profile") else None
        self.profile = cProfile.Profile(time.process_time) if self.path else None

    def start(self) -> None:
        """Start recording (at the first timed step)."""
        if self.profile is not None:
            self.profile.enable()

    def stop(self) -> None:
        """Stop, and write ``profile_<side>.prof`` and the top functions by own time as text."""
        import io
        import pstats

        if self.profile is None:
            return
        self.profile.disable()
        self.profile.dump_stats(f"{self.path}.prof")
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("tottime").print_stats(30)
        Path(f"{self.path}.txt").write_text(text.getvalue())


def periods(marks: list[tuple[float, float, float]]) -> dict[str, list[float]]:
    """Step periods between consecutive marks: wall, CPU and run-queue wait."""
    pairs = list(zip(marks, marks[1:]))
    return {
        "periods": [b[0] - a[0] for a, b in pairs],
        "cpu_periods": [b[1] - a[1] for a, b in pairs],
        "wait_periods": [b[2] - a[2] for a, b in pairs],
    }
