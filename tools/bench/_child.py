"""Child-process plumbing shared by the side-by-side benchmarks (pretrain, sft, grpo).

Each side of a comparison runs in a fresh interpreter (``script --child KIND --child-spec FILE``)
so that imports, allocator state and threads do not leak between sides; the child prints its
result as one ``MARK``-prefixed JSON line on stdout, everything else goes to a log file.
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
    return json.loads(lines[-1][len(MARK) :])


def child_main(children: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]], kind: str, spec_file: str) -> int:
    """The child side of :func:`run_child`: run ``children[kind]`` and print its result line."""
    result = children[kind](json.loads(Path(spec_file).read_text()))
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    return 0
