"""Plumbing shared by the benchmarks: child processes, load records, tables and JSON files.

Each side of a comparison runs in a fresh interpreter (``script --child KIND --child-spec FILE``)
so that imports, allocator state and threads do not leak between sides; the child prints its
result as one ``MARK``-prefixed JSON line on stdout, everything else goes to a log file.

Honest records: :func:`run_child` adds the load average before and after every child to its
result (``load_around``); :class:`LoadRecord` keeps the whole benchmark's, says which rows saw
a busy machine (``noisy``: a 1-minute load average above ``--max-load``, default cores + 1,
our own run included) and refuses to write a table for the docs from a busy run.
:func:`add_record_args` gives a benchmark its ``--table FILE`` and ``--max-load``; the benchmarks that
measure in one process print their rows with :func:`render` (a rich table on the console, every row
marked noisy when the machine was busy, the markdown for ``--table`` returned) and :func:`finish`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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


def add_record_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--table FILE`` (the markdown table for the docs, refused from a busy run) and ``--max-load``."""
    parser.add_argument(
        "--table",
        default=None,
        help="write the markdown table (for the docs) to this file; refused (exit status 2) when the machine was busy",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="the busiest 1-minute load average of a quiet run (default: cores + 1); above it rows are noisy",
    )


def load_range(runs: list[dict[str, Any]]) -> list[float]:
    """The lowest and highest load average the runs of one row recorded."""
    values = LoadRecord.loads(runs)
    return [min(values), max(values)] if values else [float("nan")] * 2


def mark(name: str, noisy: bool) -> str:
    """A row's name, with `` (noisy)`` when it was measured on a busy machine."""
    return f"{name} (noisy)" if noisy else name


def markdown(header: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of ``rows`` under the ``header`` line."""
    lines = [header, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(
    console: Any,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    record: LoadRecord,
    bold: Sequence[bool] = (),
    left: int = 1,
) -> str:
    """Print ``rows`` as a rich table (each row named noisy when the run was busy) and return them as the
    markdown table for the docs, headed by ``title`` and the load record. ``left``: left-justified columns."""
    from rich.table import Table

    noisy = record.busy()
    rows = [[mark(row[0], noisy), *row[1:]] for row in rows]
    table = Table(title=title, title_justify="left")
    for number, column in enumerate(columns):
        table.add_column(column, justify="left" if number < left else "right")
    for number, row in enumerate(rows):
        table.add_row(*row, style="bold" if number < len(bold) and bold[number] else None)
    console.print(table)
    return markdown(f"{title}; {record.header(noisy)}", columns, rows)


def finish(record: LoadRecord, table_path: str | None, table: str) -> int:
    """Print the load record's line (on stderr) and write ``table`` to ``table_path`` unless the run was
    busy; the exit status (2: refused)."""
    noisy = record.busy()
    sys.stderr.write(record.header(noisy) + "\n")
    return record.write_table(table_path, table, noisy)


def run_meta(args: argparse.Namespace, record: LoadRecord | None = None, **extra: Any) -> dict[str, Any]:
    """What a JSON file of results records about the run: its arguments, device, versions, threads, load."""
    import torch

    from mindspeed.device import get_accelerator

    meta = {
        **vars(args),
        **extra,
        "device": str(get_accelerator().device()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if record is not None:
        meta.update(load_before=record.before, load_after=load_average(), max_load=record.max_load)
    return meta


def write_json(path: str | None, payload: Any, console: Any = None) -> None:
    """Write ``payload`` as JSON to ``path`` atomically (nothing without a path); say so on ``console``."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(payload, out, indent=2, default=str)
    os.replace(tmp, path)
    if console is not None:
        console.print(f"wrote {path}")


@contextmanager
def one_megatron_rank(features: Any = None) -> Iterator[Any]:
    """megatron-core adapted (``adapt(features=...)``) on one rank of the accelerator's backend, its
    parallel state set up, all undone on exit; yields the adaptor's report (its ``kernels``)."""
    import torch.distributed as dist

    from mindspeed.device import get_accelerator
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.testing.distributed import find_free_port
    from mindspeed.testing.megatron import ParallelSizes, destroy_parallel, init_parallel

    report = adapt() if features is None else adapt(features=features)
    dist.init_process_group(
        get_accelerator().dist_backend, init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1
    )
    init_parallel(ParallelSizes())
    try:
        yield report
    finally:
        destroy_parallel()
        dist.destroy_process_group()
        unadapt()


def steps_in_trainer(config: Any, steps: Callable[[Any], dict[str, Any]], threads: int) -> dict[str, Any]:
    """Build the LLM trainer for ``config`` (its model, optimizer and data as ``pretrain`` builds them) and run
    ``steps(trainer)`` in place of its training loop; returns what ``steps`` returned (the in-process A/B drivers)."""
    import torch

    torch.set_num_threads(threads)
    import mindspeed_llm.training.trainer as trainer_module

    out: dict[str, Any] = {}

    def train(self: Any) -> Any:
        out.update(steps(self))
        return trainer_module.TrainResult(num_parameters=self.num_parameters)

    trainer_module.Trainer.train = train
    trainer_module.pretrain(config)
    return out


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


def run_bench(script: str, argv: Sequence[str], work: Path) -> Any:
    """Run ``tools/bench/<script> argv --json`` in a fresh interpreter; its JSON (stdout in a log)."""
    out, log = work / f"{Path(script).stem}.json", work / f"{Path(script).stem}.log"
    out.unlink(missing_ok=True)  # a stale result must not pass for this run's
    with open(log, "w") as sink:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve().parent / script), *argv, "--json", str(out)],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode not in (0, 2) or not out.is_file():  # 2: a busy machine (no table written)
        raise RuntimeError(f"{script} failed (exit status {proc.returncode}); its log: {log}")
    return json.loads(out.read_text())


def child_main(children: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]], kind: str, spec_file: str) -> int:
    """The child side of :func:`run_child`: run ``children[kind]`` and print its result line."""
    result = children[kind](json.loads(Path(spec_file).read_text()))
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    return 0
