"""Child-process plumbing shared by the side-by-side benchmarks (pretrain, sft, grpo).

Each side of a comparison runs in a fresh interpreter (``script --child KIND --child-spec FILE``)
so that imports, allocator state and threads do not leak between sides; the child prints its
result as one ``MARK``-prefixed JSON line on stdout, everything else goes to a log file.

Honest records: :func:`run_child` adds the load average before and after every child to its
result (``load_around``); :class:`LoadRecord` keeps the whole benchmark's, says which rows saw
a busy machine (``noisy``: a 1-minute load average above ``--max-load``, default cores + 1,
our own run included) and refuses to write a table for the docs from a busy run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MARK = "BENCH-RESULT "
MB = 1e6


def load_average() -> float:
    """The 1-minute load average (``nan`` where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def default_max_load() -> float:
    """The busiest 1-minute load average a quiet run may see: the cores plus one (the run itself
    keeps up to its threads runnable; a quiet 2-core machine measured about 1 to 2)."""
    return float((os.cpu_count() or 1) + 1)


class LoadRecord:
    """The load averages a benchmark saw, and whether its rows are fit for the docs.

    Args:
        max_load: the busiest 1-minute load average of a quiet run (:func:`default_max_load`).
    """

    def __init__(self, max_load: float | None = None) -> None:
        self.max_load = default_max_load() if max_load is None else max_load
        self.before = load_average()

    @staticmethod
    def loads(runs: list[dict[str, Any]]) -> list[float]:
        """Every load average the runs of one row recorded (around each child, and inside it)."""
        values: list[float] = []
        for run in runs:
            values += list(run.get("load_around", ())) + list(run.get("load", ()))
        return values

    def noisy(self, runs: list[dict[str, Any]]) -> bool:
        """Whether any of the runs of a row saw the machine busier than :attr:`max_load`."""
        return any(value > self.max_load for value in self.loads(runs))

    def busy(self) -> bool:
        """Whether the load average before or now is above :attr:`max_load`."""
        return max(self.before, load_average()) > self.max_load

    def header(self, rows_noisy: bool) -> str:
        """One sentence for the table's header: the load before and after, and the verdict."""
        verdict = (
            f"BUSY: rows marked noisy, NOT for the docs (a load above {self.max_load:.1f}; re-run on a quiet machine)"
            if rows_noisy
            else f"quiet (every load at most {self.max_load:.1f})"
        )
        return f"load average {self.before:.1f} -> {load_average():.1f} on {os.cpu_count()} cores: {verdict}"

    def write_table(self, path: str | None, table: str, rows_noisy: bool) -> int:
        """Write ``table`` (for the docs) to ``path`` unless a row was noisy; the exit status (2: refused)."""
        if path is None:
            return 0
        if rows_noisy:
            sys.stderr.write(f"not writing {path}: the machine was busy during the runs (rows marked noisy)\n")
            return 2
        Path(path).write_text(table)
        return 0


def main_with_load_record(main: Callable[[], int]) -> int:
    """Run a benchmark's ``main()`` and print (on stderr, so that output parsed by a parent stays
    as it is) the load average before and after it, with the verdict: quiet, or busy and not for
    the docs. For the benchmarks without per-row records (:class:`LoadRecord` in pretrain, sft)."""
    record = LoadRecord()
    status = main()
    busy = record.busy()
    sys.stderr.write(record.header(busy).replace("rows marked noisy, ", "numbers noisy, ") + "\n")
    return status


def memory_status() -> dict[str, float]:
    """Current and peak resident set size of this process in MB (``VmRSS``, ``VmHWM``)."""
    values = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024 / MB  # kB
    except OSError:  # not Linux: the peak from getrusage (KiB on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        values = {"VmRSS": float("nan"), "VmHWM": peak * (1 if sys.platform == "darwin" else 1024) / MB}
    return {"rss_mb": values["VmRSS"], "peak_rss_mb": values["VmHWM"]}


def run_child(
    script: str, kind: str, spec: Mapping[str, Any], log: Path, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run ``script --child kind`` on ``spec`` in a fresh interpreter (stderr in ``log``); its result.

    ``spec["threads"]`` sets the child's OpenMP / MKL threads; ``env`` adds variables. The spec is
    passed as a JSON file next to the log (command lines have a length limit).
    """
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "MKL_NUM_THREADS": str(spec["threads"]),
        **(env or {}),
    }
    spec_file = log.with_suffix(".json")
    spec_file.write_text(json.dumps(spec))
    before = load_average()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, script, "--child", kind, "--child-spec", str(spec_file)],
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            env=full_env,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed (exit status {proc.returncode}); its log: {log}")
    result = json.loads(lines[-1][len(MARK) :])
    result["load_around"] = [before, load_average()]
    return result


def child_main(children: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]], kind: str, spec_file: str) -> int:
    """The child side of :func:`run_child`: run ``children[kind]`` and print its result line."""
    result = children[kind](json.loads(Path(spec_file).read_text()))
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    return 0
