"""Benchmark every kernel implementation of every op against its naive PyTorch version.

For each op in the registry this builds the op's ``bench_case`` on the current accelerator,
then runs the naive version (``OpSpec.naive``, or the reference where the op has none) and
every implementation available here, side by side in one process, and reports for each the
median time of forward + backward (forward only for in-place ops, whose case has
``grad=False``), in wall and in CPU (process) time, and the peak memory the call adds, each
with its ratio to the naive version.

Usage::

    uv run --frozen python tools/bench/ops.py
    uv run --frozen python tools/bench/ops.py --ops rms_norm,swiglu --dtype bfloat16 --repeat 10
    uv run --frozen python tools/bench/ops.py --no-backward --json bench.json
    uv run --frozen python tools/bench/ops.py --compile   # include impl="compile" (slow on CPU)
    uv run --frozen python tools/bench/ops.py --table ops.md   # refused (exit 2) on a busy machine

An implementation that raises is reported as an error row and the run goes on; the exit
status is then 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import torch
from rich.console import Console

from mindspeed.device import get_accelerator
from mindspeed.metrics import measure_peak_memory, resolve_method
from mindspeed.ops import OPS, Case, OpSpec, available_kernels
from mindspeed.testing.parity import flatten_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAIVE = "naive"
COMPILE = "compile"
MIB = float(1 << 20)


@dataclass
class Row:
    """One implementation's measurements (``None`` where it could not be measured)."""

    op: str
    impl: str
    baseline: bool = False
    time_ms: float | None = None
    cpu_ms: float | None = None
    runs: int = 0
    peak_mib: float | None = None
    time_ratio: float | None = None
    cpu_ratio: float | None = None
    memory_ratio: float | None = None
    error: str | None = None
    note: str | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated op names (default: every registered op)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the bench inputs")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per implementation (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (at least 1)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=3.0,
        help="stop the timed rounds of an op after about this many seconds per implementation (at least 2 rounds)",
    )
    parser.add_argument(
        "--backward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time forward + backward (in-place ops are always forward only)",
    )
    parser.add_argument("--compile", action="store_true", help='also run impl="compile" (compiling is slow on CPU)')
    parser.add_argument("--json", default="", help="also write the measurements to this JSON file")
    _child.add_record_args(parser)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 1:
        parser.error("--repeat and --warmup must be at least 1")
    return args


def select_ops(names: str) -> list[str]:
    """The ops to run: the comma-separated ``names`` (checked against the registry) or all."""
    if not names:
        return [str(op) for op in OPS.keys()]
    selected = [name.strip() for name in names.split(",") if name.strip()]
    for name in selected:
        OPS.get(name)  # raises with the list of known ops
    return selected


def candidates(spec: OpSpec, case: Case, device: str, include_compile: bool) -> list[tuple[str, Callable[..., Any]]]:
    """``(name, fn)`` pairs to measure, the naive baseline first.

    Where the op has no ``naive`` the reference is the baseline.
    """
    impls = [
        impl for impl in available_kernels(spec.name, device, case.features) if include_compile or impl.name != COMPILE
    ]
    impls.sort(key=lambda impl: impl.name != "reference")  # stable: keeps best-first order after it
    pairs: list[tuple[str, Callable[..., Any]]] = []
    if spec.naive is not None:
        pairs.append((NAIVE, spec.naive))
    pairs += [(impl.name, impl.fn) for impl in impls]
    return pairs


def _clone(value: Any, requires_grad: bool) -> Any:
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(True) if requires_grad and copy.is_floating_point() else copy
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v, requires_grad) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v, requires_grad) for k, v in value.items()}
    return value


class Runner:
    """Calls one implementation on fresh copies of the case's inputs, with its backward.

    The inputs are cloned before every call (outside the timed region), so in-place ops
    always see the same values and gradients never accumulate across runs.
    """

    def __init__(self, fn: Callable[..., Any], case: Case, backward: bool) -> None:
        self.fn, self.case = fn, case
        self.backward = backward and case.grad
        self.cotangents: list[torch.Tensor] | None = None

    def inputs(self) -> tuple[tuple, dict]:
        return _clone(self.case.args, self.backward), _clone(self.case.kwargs, self.backward)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        out = self.fn(*args, **kwargs)
        if self.backward:
            outs = [o for o in flatten_tensors(out) if o.is_floating_point() and o.requires_grad]
            if self.cotangents is None:  # first (warm-up) call: fixed random output gradients
                self.cotangents = [torch.randn_like(o) for o in outs]
            if outs:
                torch.autograd.backward(outs, grad_tensors=self.cotangents)
        return out


def time_once(runner: Runner) -> tuple[float, float]:
    """Wall and CPU (process) seconds of one call of ``runner`` on fresh inputs (cloning them is not timed)."""
    accelerator = get_accelerator()
    args, kwargs = runner.inputs()
    accelerator.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = runner(args, kwargs)
    accelerator.synchronize()
    elapsed = time.perf_counter() - start, time.process_time() - cpu_start
    del out, args, kwargs
    return elapsed


def measure_runner(runner: Runner) -> float:
    """Peak MiB that one call of ``runner`` (forward and backward) adds."""
    args, kwargs = runner.inputs()
    with measure_peak_memory() as mem:
        out = runner(args, kwargs)
        del out
    return mem.peak_bytes / MIB


def _short(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:120]}"


def bench_op(op: str, dtype: torch.dtype, args: argparse.Namespace) -> tuple[list[Row], str]:
    """Measure every candidate of ``op``; returns the rows and a description of the case."""
    spec = OPS.get(op)
    device = get_accelerator().device()
    if spec.bench_case is None:
        return [Row(op=op, impl="-", error="the op declares no bench_case")], "no bench case"
    torch.manual_seed(0)
    try:
        case = spec.bench_case(dtype, device)
    except Exception as err:  # a broken bench case is reported, the other ops still run
        return [Row(op=op, impl="-", error=f"bench_case failed: {_short(err)}")], "bench_case failed"
    mode = "fwd+bwd" if args.backward and case.grad else "fwd"
    rows: list[Row] = []
    runners: dict[int, Runner] = {}  # row index -> runner, for the rows that still work
    for index, (label, fn) in enumerate(candidates(spec, case, device.type, args.compile)):
        rows.append(Row(op=op, impl=label, baseline=index == 0))
        runner = Runner(fn, case, args.backward)
        try:
            for _ in range(args.warmup):
                runner(*runner.inputs())
            runners[index] = runner
        except Exception as err:  # an implementation that fails is a row, not a crash
            rows[index].error = _short(err)
    # Round-robin: every implementation runs once per round, so a load change on the machine
    # shifts all of them alike and the ratios stay fair.
    times: dict[int, list[tuple[float, float]]] = {index: [] for index in runners}
    started = time.perf_counter()
    for round_index in range(args.repeat):
        for index in list(runners):
            try:
                times[index].append(time_once(runners[index]))
            except Exception as err:
                rows[index].error = _short(err)
                del runners[index]
        if round_index >= 1 and time.perf_counter() - started > args.budget_s * max(1, len(runners)):
            break
    for index, runner in runners.items():
        rows[index].time_ms = statistics.median(wall for wall, _ in times[index]) * 1000.0
        rows[index].cpu_ms = statistics.median(cpu for _, cpu in times[index]) * 1000.0
        rows[index].runs = len(times[index])
        if rows[index].impl == COMPILE and resolve_method() == "dispatch":
            # torch.compile steps aside while a dispatch mode is active and runs the reference
            # eagerly, so the number would be the reference's, not the compiled code's.
            rows[index].note = "peak n/a: compiled code is not traced by dispatch tracking"
            continue
        try:
            rows[index].peak_mib = measure_runner(runner)
        except Exception as err:
            rows[index].error = f"memory: {_short(err)}"
    base = rows[0] if rows else Row(op=op, impl="-")
    for row in rows:
        if base.time_ms and row.time_ms is not None:
            row.time_ratio = row.time_ms / base.time_ms
        if base.cpu_ms and row.cpu_ms is not None:
            row.cpu_ratio = row.cpu_ms / base.cpu_ms
        if base.peak_mib and row.peak_mib is not None:
            row.memory_ratio = row.peak_mib / base.peak_mib
    return rows, f"{case.name}, {str(dtype)[6:]}, {device}, {mode}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render(console: Console, op: str, description: str, rows: list[Row], record: _child.LoadRecord) -> str:
    """Print one op's table (time ratios in wall and CPU time); its markdown."""
    columns = ("impl", "wall ms", "wall / naive", "CPU ms", "CPU / naive", "peak MiB", "mem / naive", "runs", "note")
    cells = [
        (
            f"{row.impl} ({NAIVE})" if row.baseline and row.impl != NAIVE else row.impl,
            _fmt(row.time_ms, ".2f"),
            _fmt(row.time_ratio, ".2f", "x"),
            _fmt(row.cpu_ms, ".2f"),
            _fmt(row.cpu_ratio, ".2f", "x"),
            _fmt(row.peak_mib, ".1f"),
            _fmt(row.memory_ratio, ".2f", "x"),
            str(row.runs or "-"),
            row.error or row.note or "",
        )
        for row in rows
    ]
    return _child.render(console, f"{op}  ({description})", columns, cells, record, [row.baseline for row in rows])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    # Piped output gets a fixed width, so that the tables do not wrap at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        ops = select_ops(args.ops)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    dtype = DTYPES[args.dtype]
    meta = _child.run_meta(args, memory_method=resolve_method())
    console.print(
        f"device {meta['device']}, torch {meta['torch']}, {meta['threads']} threads, {args.dtype}, "
        f"median of up to {args.repeat} runs after {args.warmup} warm-up, peak memory via {meta['memory_method']}"
    )
    all_rows: list[Row] = []
    tables: list[str] = []
    started = time.perf_counter()
    for op in ops:
        rows, description = bench_op(op, dtype, args)
        tables.append(render(console, op, description, rows, record))
        all_rows += rows
    console.print(f"done in {time.perf_counter() - started:.1f} s")
    meta.update(load_before=record.before, load_after=_child.load_average())
    _child.write_json(args.json, {"meta": meta, "rows": [asdict(row) for row in all_rows]}, console)
    status = _child.finish(record, args.table, "\n".join(tables))
    return 1 if any(row.error for row in all_rows) else status


if __name__ == "__main__":
    sys.exit(main())
