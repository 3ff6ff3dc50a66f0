"""Benchmark context-parallel attention: peak memory per rank and time at CP = 1, 2, 4.

For every CP degree one group of real ranks is spawned (gloo on the CPU, one thread per
rank); each rank runs forward + backward of ``context_parallel_attention`` on its own shard
for every algorithm and sequence length, and reports the median time and the peak tensor
memory the call adds (``mindspeed.metrics.measure_peak_memory``: allocator counters on a
device, dispatch tracking on the CPU). CP = 1 is plain attention on the whole sequence with
the same kernel; the table puts every row's ratios to it side by side.

Usage::

    uv run --frozen python tools/bench/cp.py
    uv run --frozen python tools/bench/cp.py --seq-lens 1024,2048 --cp 1,2 --algos megatron_cp_algo
    uv run --frozen python tools/bench/cp.py --impl auto --no-causal --json cp.json
    uv run --frozen python tools/bench/cp.py --table cp.md   # refused (exit 2) on a busy machine

On a CPU host the ranks share the cores (4 ranks on 2 cores run two at a time), so wall
time at CP = 4 there says little about speed-up; the per-rank CPU time does, and the memory
per rank is exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import torch
import torch.distributed as dist
from rich.console import Console

from mindspeed.metrics import measure_peak_memory, resolve_method
from mindspeed.parallel.context_parallel import (
    ALGOS,
    HYBRID,
    RING,
    build_context_parallel_groups,
    context_parallel_attention,
    shard_lengths,
)
from mindspeed.testing.distributed import run_distributed

MIB = float(1 << 20)
BASELINE = "none (CP=1)"


@dataclass
class Row:
    """One (algorithm, sequence length, CP degree) measurement; memory and time are the worst rank's."""

    algo: str
    seq_len: int
    cp: int
    layout: str  # "U2 x R2" for hybrid_cp_algo, else empty
    local_seq: int
    peak_mib: float
    time_ms: float
    cpu_ms: float
    memory_ratio: float | None = None
    time_ratio: float | None = None
    cpu_ratio: float | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096", help="comma-separated full sequence lengths")
    parser.add_argument("--cp", default="1,2,4", help="comma-separated CP degrees (1 is the baseline)")
    parser.add_argument("--algos", default=",".join(ALGOS), help="comma-separated algorithms")
    parser.add_argument("--ulysses-degree", type=int, default=2, help="ulysses_degree_in_cp of hybrid_cp_algo")
    parser.add_argument(
        "--cp-window-size",
        type=int,
        default=1,
        help="also run the double ring (megatron_cp_algo with this window) where it divides the CP degree",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--impl",
        default="reference",
        help="attention kernel; 'reference' everywhere keeps CP=1 and every algorithm on the same kernel "
        "(ring attention needs one that returns lse: on the CPU only the reference does)",
    )
    parser.add_argument("--repeat", type=int, default=2, help="timed runs (median reported) after one warm-up")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    _child.add_record_args(parser)
    args = parser.parse_args(argv)
    args.seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    args.cp = sorted({int(c) for c in args.cp.split(",") if c} | {1})
    args.algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    for algo in args.algos:
        if algo not in ALGOS:
            parser.error(f"unknown algorithm {algo!r}; use one of: {', '.join(ALGOS)}")
    return args


#: The double ring's row label (``megatron_cp_algo`` with ``--cp-window-size``).
DOUBLE_RING = "megatron_cp_algo (double ring)"


def _algos_for(cp: int, args: argparse.Namespace) -> list[str]:
    if cp == 1:
        return [RING]  # a ring of one is plain attention through the same entry
    algos = [a for a in args.algos if a != HYBRID or (cp % args.ulysses_degree == 0 and cp > args.ulysses_degree)]
    window = getattr(args, "cp_window_size", 1)
    if RING in algos and 1 < window < cp and cp % window == 0:
        algos.append(DOUBLE_RING)
    return algos


def bench_rank(rank: int, world_size: int, settings: dict) -> list[dict]:
    """Measure every algorithm and length on this rank (runs inside the spawned group)."""
    args = argparse.Namespace(**settings)
    results = []
    for label in _algos_for(world_size, args):
        algo = RING if label == DOUBLE_RING else label
        degree = args.ulysses_degree if algo == HYBRID else 1
        window = args.cp_window_size if label == DOUBLE_RING else 1
        groups = build_context_parallel_groups(dist.group.WORLD, algo, degree, cp_window_size=window)
        for seq_len in args.seq_lens:
            local = shard_lengths(seq_len, world_size, algo, degree)[groups.cp_rank]
            gen = torch.Generator().manual_seed(rank)
            shape = (args.batch, local)
            q = torch.randn(*shape, args.heads, args.head_dim, generator=gen).requires_grad_(True)
            k, v = (torch.randn(*shape, args.kv_heads, args.head_dim, generator=gen).requires_grad_(True) for _ in "kv")
            grad = torch.randn(*shape, args.heads, args.head_dim, generator=gen)

            def step() -> None:
                out = context_parallel_attention(
                    q,
                    k,
                    v,
                    algo=algo,
                    cp_group=groups.cp_group,
                    ulysses_group=groups.ulysses_group,
                    ring_group=groups.ring_group,
                    inner_ring_group=groups.inner_ring_group,
                    outer_ring_group=groups.outer_ring_group,
                    causal=args.causal,
                    seq_len=seq_len,
                    impl=args.impl,
                )
                out.backward(grad)
                q.grad = k.grad = v.grad = None

            step()  # warm-up: kernels resolved, plans cached
            wall, cpu = [], []
            for _ in range(args.repeat):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            dist.barrier()
            with measure_peak_memory() as mem:
                step()
            results.append(
                {
                    "algo": label,
                    "seq_len": seq_len,
                    "local_seq": local,
                    "peak_mib": mem.peak_bytes / MIB,
                    "time_ms": statistics.median(wall) * 1e3,
                    "cpu_ms": statistics.median(cpu) * 1e3,
                }
            )
    return results


def collect(args: argparse.Namespace) -> list[Row]:
    """Spawn one group per CP degree and reduce the ranks' numbers to rows (worst rank)."""
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    rows: list[Row] = []
    for cp in args.cp:
        per_rank = run_distributed(bench_rank, cp, settings, timeout=3600)
        for index, first in enumerate(per_rank[0]):
            ranks = [results[index] for results in per_rank]
            algo = BASELINE if cp == 1 else first["algo"]
            layout = f"U{args.ulysses_degree} x R{cp // args.ulysses_degree}" if first["algo"] == HYBRID else ""
            if first["algo"] == DOUBLE_RING:
                layout = f"{cp // args.cp_window_size} windows x {args.cp_window_size}"
            rows.append(
                Row(
                    algo=algo,
                    seq_len=first["seq_len"],
                    cp=cp,
                    layout=layout,
                    local_seq=max(r["local_seq"] for r in ranks),
                    peak_mib=max(r["peak_mib"] for r in ranks),
                    time_ms=max(r["time_ms"] for r in ranks),
                    cpu_ms=statistics.mean(r["cpu_ms"] for r in ranks),
                )
            )
    base = {row.seq_len: row for row in rows if row.cp == 1}
    for row in rows:
        ref = base.get(row.seq_len)
        if ref is not None:
            row.memory_ratio = row.peak_mib / ref.peak_mib if ref.peak_mib else None
            row.time_ratio, row.cpu_ratio = row.time_ms / ref.time_ms, row.cpu_ms / ref.cpu_ms
    return rows


def render(console: Console, rows: list[Row], title: str, record: _child.LoadRecord) -> str:
    """One table: every algorithm, length and degree, with the ratios to CP = 1 (wall and CPU); its markdown."""
    columns = (
        "algo",
        "seq",
        "CP",
        "local seq",
        "peak MiB/rank",
        "mem / CP1",
        "1/CP",
        "wall ms",
        "wall / CP1",
        "cpu ms/rank",
        "cpu / CP1",
    )
    ordered = sorted(rows, key=lambda r: (r.seq_len, r.cp != 1, r.algo, r.cp))
    cells = [
        (
            f"{row.algo} ({row.layout})" if row.layout else row.algo,
            str(row.seq_len),
            str(row.cp),
            str(row.local_seq),
            f"{row.peak_mib:.1f}",
            f"{row.memory_ratio:.3f}" if row.memory_ratio is not None else "-",
            f"{1 / row.cp:.3f}",
            f"{row.time_ms:.0f}",
            f"{row.time_ratio:.2f}" if row.time_ratio is not None else "-",
            f"{row.cpu_ms:.0f}",
            f"{row.cpu_ratio:.2f}" if row.cpu_ratio is not None else "-",
        )
        for row in ordered
    ]
    return _child.render(console, title, columns, cells, record, [row.cp == 1 for row in ordered])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 140)
    meta = _child.run_meta(args, memory_method=resolve_method(), cores=os.cpu_count())
    started = time.perf_counter()
    rows = collect(args)
    title = (
        f"context-parallel attention fwd+bwd, b{args.batch} n{args.heads}/{args.kv_heads} d{args.head_dim} "
        f"{'causal' if args.causal else 'full'}, impl {args.impl}, fp32, memory via {meta['memory_method']}, "
        f"{meta['cores']} cores"
    )
    table = render(console, rows, title, record)
    console.print(f"done in {time.perf_counter() - started:.1f} s")
    meta.update(load_before=record.before, load_after=_child.load_average())
    _child.write_json(args.json, {"meta": meta, "rows": [asdict(r) for r in rows]}, console)
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    sys.exit(main())
