"""Benchmark gradient-accumulation fusion: a megatron-core GPT's forward + backward with and without it.

The ``gradient_accumulation_fusion`` feature makes megatron's linear layers add each weight
gradient into the fp32 ``main_grad`` through the registry's ``matmul_add_fp32`` (one GEMM into
the buffer) instead of computing the weight gradient in the parameter dtype and adding it
afterwards (megatron's DDP hook). This script builds the same tiny GPT (one rank, megatron's
DDP with ``grad_reduce_in_fp32``) in fp32 and in bf16, with the flag off and on, and times
megatron's schedule over several microbatches (the accumulation the fusion is for). Variants
run round-robin so a load change on the shared machine shifts all of them alike; the table
prints the median wall and CPU (process) time per step and each fused variant's ratio to the
unfused one of its precision, side by side. Usage::

    uv run --frozen python tools/bench/grad_accum.py
    uv run --frozen python tools/bench/grad_accum.py --hidden 1024 --seq 1024 --json gaf.json
    uv run --frozen python tools/bench/grad_accum.py --table gaf.md   # refused (exit 2) on a busy machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import torch
from rich.console import Console

from mindspeed.device import get_accelerator

PRECISIONS = ("fp32", "bf16")


@dataclass
class Row:
    """One variant's measurements (times per step, ratios to the unfused run of the same precision)."""

    precision: str
    fused: bool
    kernel: str = "-"
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    wall_ratio: float = 1.0
    cpu_ratio: float = 1.0
    kernel_calls: int = 0
    runs: int = 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--ffn", type=int, default=768, help="MLP width")
    parser.add_argument("--seq", type=int, default=256, help="sequence length")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (accumulated)")
    parser.add_argument("--repeat", type=int, default=9, help="timed rounds (median reported)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="stop timing after about this many seconds")
    parser.add_argument("--json", default="", help="also write the measurements to this JSON file")
    _child.add_record_args(parser)
    return parser.parse_args(argv)


def _build(args: argparse.Namespace, precision: str, fused: bool, kernels: Any) -> tuple[list[Any], Any]:
    from megatron.core.distributed import DistributedDataParallelConfig

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.megatron import ParallelSizes, TinyGPTConfig, build_gpt

    model = TinyGPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=max(1, args.hidden // 64),
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=1024,
        seq_length=args.seq,
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return build_gpt(
        model,
        ParallelSizes(),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        layer_spec=get_gpt_layer_spec(kernels),
        use_te_activation_func=True,
        bias_activation_fusion=False,
        bf16=precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        gradient_accumulation_fusion=fused,
    ), model


def run(args: argparse.Namespace, kernels: Any) -> list[Row]:
    """Measure every variant; rows in (precision, unfused / fused) order."""
    from mindspeed.testing.kernels import calls_of, count_kernel_calls
    from mindspeed.testing.megatron import make_batches, run_forward_backward

    accelerator = get_accelerator()
    variants: dict[tuple[str, bool], Any] = {}
    rows: dict[tuple[str, bool], Row] = {}
    batches = None
    for precision in PRECISIONS:
        for fused in (False, True):
            chunks, model = _build(args, precision, fused, kernels)
            batches = batches or make_batches(model, args.microbatches, args.micro_batch_size)
            variants[(precision, fused)] = chunks
            rows[(precision, fused)] = Row(precision, fused, kernels.kernel_for("matmul_add_fp32") if fused else "-")
    for key, chunks in variants.items():  # warm-up, and proof the kernel runs (or not)
        with count_kernel_calls() as calls:
            run_forward_backward(chunks, batches)
        rows[key].kernel_calls = calls_of(calls, "matmul_add_fp32")
    wall: dict[tuple[str, bool], list[float]] = {key: [] for key in variants}
    cpu: dict[tuple[str, bool], list[float]] = {key: [] for key in variants}
    started = time.perf_counter()
    for round_index in range(args.repeat):
        for key, chunks in variants.items():
            accelerator.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            run_forward_backward(chunks, batches)
            accelerator.synchronize()
            wall[key].append(time.perf_counter() - w0)
            cpu[key].append(time.process_time() - c0)
        if round_index >= 1 and time.perf_counter() - started > args.budget_s:
            break
    for key, row in rows.items():
        row.wall_ms, row.cpu_ms = statistics.median(wall[key]) * 1e3, statistics.median(cpu[key]) * 1e3
        row.runs = len(wall[key])
    for key, row in rows.items():
        base = rows[(key[0], False)]
        row.wall_ratio, row.cpu_ratio = row.wall_ms / base.wall_ms, row.cpu_ms / base.cpu_ms
    return list(rows.values())


def render(console: Console, title: str, rows: list[Row], record: _child.LoadRecord) -> str:
    """Print the table: per precision, unfused then fused with its ratios (wall and CPU); its markdown."""
    columns = (
        "precision",
        "fusion",
        "kernel",
        "wall ms",
        "wall / unfused",
        "cpu ms",
        "cpu / unfused",
        "kernel calls",
        "runs",
    )
    cells = [
        (
            row.precision,
            "on" if row.fused else "off",
            row.kernel,
            f"{row.wall_ms:.1f}",
            f"{row.wall_ratio:.2f}x",
            f"{row.cpu_ms:.1f}",
            f"{row.cpu_ratio:.2f}x",
            str(row.kernel_calls),
            str(row.runs),
        )
        for row in rows
    ]
    return _child.render(console, title, columns, cells, record, [not row.fused for row in rows], left=3)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 140)
    from mindspeed.features import FeaturesConfig

    accelerator = get_accelerator()
    # Only the fusion feature: its patch is in place, and each model's config flag decides.
    fusion = FeaturesConfig(optimization_level=0, settings={"gradient_accumulation_fusion": True})
    with _child.one_megatron_rank(fusion) as report:
        rows = run(args, report.kernels)
    title = (
        f"GPT fwd+bwd per step, gradient accumulation fusion off/on: {args.layers} layers, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.microbatches} microbatches x {args.micro_batch_size} x {args.seq} tokens, "
        f"{accelerator.device()}, {torch.get_num_threads()} threads"
    )
    table = render(console, title, rows, record)
    meta = _child.run_meta(args, record)
    _child.write_json(args.json, {"meta": meta, "rows": [asdict(row) for row in rows]}, console)
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    sys.exit(main())
