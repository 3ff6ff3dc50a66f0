"""Benchmark ``preprocess-data`` throughput with 1 worker and with more.

Builds an input by repeating the shipped demo corpus (or the demo Alpaca set) until it holds
``--records`` records, then runs :func:`mindspeed_llm.data.preprocess_data` with each worker
count, round-robin, ``--repeats`` times, and reports the median time of the processing phase
(reading, tokenizing, writing; the one-off imports and tokenizer load are excluded and shown
apart), records/s, tokens/s and the speed-up over one worker, next to the "machine ceiling":
what the same number of processes gains on pure CPU work at that moment (other jobs on a
shared machine take cores), and the CPU seconds spent by the main process and by the workers
(which show how the work splits whatever the load). It also checks that every run wrote the
same bytes. Usage::

    uv run --frozen python tools/bench/preprocess.py
    uv run --frozen python tools/bench/preprocess.py --handler AlpacaStyleInstructionHandler --workers 1 2 4
    uv run --frozen python tools/bench/preprocess.py --table preprocess.md   # refused (exit 2) on a busy machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from rich.console import Console

from mindspeed_llm.data import PreprocessConfig, preprocess_data
from mindspeed_llm.tokenizer import DEMO_ALPACA, DEMO_CORPUS


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--handler",
        default="GeneralPretrainHandler",
        choices=["GeneralPretrainHandler", "AlpacaStyleInstructionHandler"],
    )
    parser.add_argument("--records", type=int, default=20000, help="records in the generated input")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (first: baseline)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per worker count (the median is reported)")
    parser.add_argument("--tokenizer", default="demo", help="tokenizer directory, or demo")
    parser.add_argument("--json", default="", help="also write the measurements to this JSON file")
    _child.add_record_args(parser)
    return parser.parse_args(argv)


def make_input(path: Path, handler: str, records: int) -> Path:
    """``records`` lines cycled from the shipped data, each made unique by a numbered suffix."""
    source = DEMO_CORPUS if handler == "GeneralPretrainHandler" else DEMO_ALPACA
    lines = [json.loads(line) for line in source.read_text().splitlines()]
    field = "text" if handler == "GeneralPretrainHandler" else "output"
    with open(path, "w") as out:
        for i in range(records):
            row = dict(lines[i % len(lines)])
            row[field] = f"{row[field]} ({i})"
            out.write(json.dumps(row) + "\n")
    return path


def _burn(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def machine_speedup(workers: int, n: int = 3_000_000) -> float:
    """What ``workers`` processes gain over one on pure CPU work right now (the ceiling for us).

    On a shared machine other jobs take cores; this puts the measured speed-up in context.
    """
    import multiprocessing

    start = time.perf_counter()
    for _ in range(workers):
        _burn(n)
    serial = time.perf_counter() - start
    with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers) as pool:
        start = time.perf_counter()
        pool.map(_burn, [n] * workers)
        parallel = time.perf_counter() - start
    return serial / parallel


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its finished children (the pool's workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def digest(prefix: str) -> str:
    folder = Path(prefix).parent
    sha = hashlib.sha256()
    for path in sorted(folder.glob(Path(prefix).name + "*")):
        sha.update(path.read_bytes())
    return sha.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 160)
    times: dict[int, list[float]] = {w: [] for w in args.workers}
    setup: dict[int, list[float]] = {w: [] for w in args.workers}
    digests: set[str] = set()
    ceilings: dict[int, list[float]] = {w: [] for w in args.workers}
    cpu: dict[int, list[tuple[float, float]]] = {w: [] for w in args.workers}
    report = None
    with tempfile.TemporaryDirectory() as tmp:
        source = make_input(Path(tmp) / "input.jsonl", args.handler, args.records)
        for repeat in range(args.repeats + 1):  # round 0 warms the page cache and the demo tokenizer
            for workers in args.workers:
                prefix = str(Path(tmp) / f"out-{workers}" / "data")
                config = PreprocessConfig(
                    input=str(source),
                    tokenizer_name_or_path=args.tokenizer,
                    output_prefix=prefix,
                    handler_name=args.handler,
                    append_eod=True,
                    workers=workers,
                    log_interval=10**9,
                )
                cpu_self, cpu_children = _cpu()
                start = time.perf_counter()
                report = preprocess_data(config)
                total = time.perf_counter() - start
                cpu_self, cpu_children = (a - b for a, b in zip(_cpu(), (cpu_self, cpu_children)))
                digests.add(digest(prefix))
                if repeat:
                    times[workers].append(report.process_seconds)
                    setup[workers].append(total - report.process_seconds)
                    cpu[workers].append((cpu_self, cpu_children))
                    ceilings[workers].append(machine_speedup(workers) if workers > 1 else 1.0)
    base = statistics.median(times[args.workers[0]])
    base_cpu = statistics.median(sum(c) for c in cpu[args.workers[0]])
    title = (
        f"preprocess-data {args.handler}: {args.records} records, {report.tokens} tokens, "
        f"{os.cpu_count()} CPUs, median of {args.repeats}"
    )
    columns = (
        "workers",
        "process s",
        "records/s",
        "tokens/s",
        "speed-up",
        "machine ceiling",
        "CPU s main",
        "CPU s workers",
        "CPU s total / first",
        "setup s",
    )
    rows, cells = [], []
    for workers in args.workers:
        median = statistics.median(times[workers])
        row = {
            "workers": workers,
            "seconds": median,
            "records_per_s": args.records / median,
            "tokens_per_s": report.tokens / median,
            "speedup": base / median,
            "machine_ceiling": statistics.median(ceilings[workers]),
            "setup_s": statistics.median(setup[workers]),
            "cpu_main_s": statistics.median(c[0] for c in cpu[workers]),
            "cpu_workers_s": statistics.median(c[1] for c in cpu[workers]),
            "cpu_ratio": statistics.median(sum(c) for c in cpu[workers]) / base_cpu,
        }
        rows.append(row)
        cells.append(
            (
                str(workers),
                f"{median:.2f}",
                f"{row['records_per_s']:.0f}",
                f"{row['tokens_per_s']:.0f}",
                f"{row['speedup']:.2f}x",
                f"{row['machine_ceiling']:.2f}x",
                f"{row['cpu_main_s']:.2f}",
                f"{row['cpu_workers_s']:.2f}",
                f"{row['cpu_ratio']:.2f}x",
                f"{row['setup_s']:.2f}",
            )
        )
    table = _child.render(console, title, columns, cells, record, left=0)
    console.print(f"identical output for every worker count: {len(digests) == 1}")
    if len(args.workers) > 1:
        last = rows[-1]
        console.print(
            f"ratio {args.workers[-1]} vs {args.workers[0]} workers: {last['speedup']:.2f}x "
            f"(pure CPU work in {args.workers[-1]} processes gained {last['machine_ceiling']:.2f}x on this machine meanwhile)"
        )
    meta = _child.run_meta(args, record, cpus=os.cpu_count(), tokens=report.tokens)
    _child.write_json(args.json, {"meta": meta, "rows": rows}, console)
    status = _child.finish(record, args.table, table)
    return status if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
