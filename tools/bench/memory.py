"""Benchmark the memory features: peak device memory and step time of one GPT training step each.

One rank trains the same megatron-core GPT (bf16 weights, fp32 masters, the distributed
optimizer, Adam) with no memory feature, with megatron's full recompute (uniform, one layer per
checkpoint) and with each memory feature of :mod:`mindspeed.features.memory` and a few
combinations, installed through the features' own hooks. Per variant:

- peak device memory of a steady-state step (forward + backward + optimizer step), counted from
  before the optimizer is built, so the optimizer state is in it: on an accelerator the
  caching allocator's peak, on the CPU the dispatch-level tracker's "device pool" (host buffers
  of the swaps excluded);
- the median wall time of a step (timed without the tracker; variants round-robin, so a load
  change on a shared machine shifts all of them alike) and beside it the median CPU time of the
  process in that step (all its threads: on a shared host the CPU time is what the variant
  costs, the wall time also what the neighbours took), both as ratios to "none";
- the device bytes held after a step, counted from before the optimizer was built (its state
  and whatever the first steps left; negative when they freed more than they left): the
  difference to "none" is what an optimizer feature keeps off the device between steps.

The load average is printed before and after, and the issue's goals are checked at the end:
activation recompute and swap_attention cost under 10 % step time; swap_optimizer frees at
least 90 % of the optimizer state's device bytes; reuse_fp32_param saves 2 bytes per parameter
at under 2 % step time.

Usage::

    uv run --frozen python tools/bench/memory.py
    uv run --frozen python tools/bench/memory.py --layers 8 --hidden 512 --seq 1024 --json memory.json
    uv run --frozen python tools/bench/memory.py --table memory.md   # refused (exit 2) on a busy machine
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

#: Variant name -> (feature settings, extra TransformerConfig fields).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "none": ({}, {}),
    "megatron full recompute": (
        {},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    ),
    "recompute_activation_function": ({"recompute_activation_function": True}, {}),
    "recompute_norm": ({"recompute_norm": True}, {}),
    "swap_attention": ({"swap_attention": True}, {}),
    "reuse_fp32_param": ({"reuse_fp32_param": True}, {}),
    "swap_optimizer (4 chunks)": ({"swap_optimizer": {"enabled": True, "swap_optimizer_times": 4}}, {}),
    "activation + norm recompute + reuse_fp32": (
        {"recompute_activation_function": True, "recompute_norm": True, "reuse_fp32_param": True},
        {},
    ),
    "activation recompute + swap_attention + swap_optimizer": (
        {
            "recompute_activation_function": True,
            "swap_attention": True,
            "swap_optimizer": {"enabled": True, "swap_optimizer_times": 4},
        },
        {},
    ),
}


@dataclass
class Row:
    """One variant's measurements."""

    variant: str
    peak_mib: float = 0.0
    peak_ratio: float = 1.0
    step_ms: float = 0.0
    time_ratio: float = 1.0
    cpu_ms: float = 0.0
    cpu_ratio: float = 1.0
    held_mib: float = 0.0
    loss: float = 0.0
    runs: int = 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--ffn", type=int, default=768, help="MLP width")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--budget-s", type=float, default=120.0, help="stop timing after about this many seconds")
    parser.add_argument(
        "--only", default="", help='comma-separated variants to run ("none" is always run); default: all'
    )
    parser.add_argument("--json", default="", help="also write the measurements to this JSON file")
    _child.add_record_args(parser)
    return parser.parse_args(argv)


def _build(args: argparse.Namespace, settings: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mindspeed.features import BuildContext, FeaturesConfig, apply_features
    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.metrics.memory import StorageTracker, resolve_method
    from mindspeed.testing.megatron import ParallelSizes, TinyGPTConfig, build_gpt, make_batches

    context = BuildContext()
    apply_features(FeaturesConfig(optimization_level=0, settings=settings), context)
    kernels = {op: "reference" for op in ("rms_norm", "layer_norm", "attention", "swiglu")}
    model = TinyGPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_attention_heads=max(1, args.hidden // 64),
        num_query_groups=max(1, args.hidden // 128),
        vocab_size=1024,
        seq_length=args.seq,
    )
    torch.manual_seed(model.seed)  # every variant starts from the same weights (same losses)
    model_parallel_cuda_manual_seed(model.seed)
    chunks = build_gpt(
        model,
        ParallelSizes(),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        layer_spec=get_gpt_layer_spec(kernels),
        use_te_activation_func=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        **overrides,
    )
    for hook in context.hooks["post_model_build"]:
        hook(chunks)
    # The optimizer state is part of the peak: on the CPU it is counted from here.
    tracker = StorageTracker() if resolve_method() == "dispatch" else None
    if tracker is not None:
        tracker.__enter__()
    get_accelerator().synchronize()
    before_optimizer = get_accelerator().memory_stats()["allocated"] if tracker is None else 0
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
            use_distributed_optimizer=True,
        ),
        chunks,
    )
    for hook in context.hooks["post_optimizer_build"]:
        optimizer = hook(optimizer) or optimizer
    batches = make_batches(model, args.microbatches, args.micro_batch_size)
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return {
        "chunks": chunks,
        "optimizer": optimizer,
        "batches": batches,
        "tracker": tracker,
        "before_optimizer": before_optimizer,
        "params": params,
    }


def _peak_of_step(variant: dict[str, Any]) -> tuple[int, int, float]:
    """Absolute peak bytes of one steady-state step, the bytes held since the optimizer was built
    (after the warm-up step), and the step's loss (the first step is a warm-up)."""
    from mindspeed.metrics.memory import measure_peak_memory
    from mindspeed.testing.megatron import train_step

    accelerator = get_accelerator()
    train_step(variant["chunks"], variant["optimizer"], variant["batches"])
    outer = variant.pop("tracker")
    if outer is not None:  # CPU: what lives now (weights, state) + the step's own peak, then stop counting
        base = outer.live_bytes
        with measure_peak_memory("dispatch") as mem:
            loss, _ = train_step(variant["chunks"], variant["optimizer"], variant["batches"])
        outer.__exit__(None, None, None)
        return base + mem.peak_bytes, base, loss
    accelerator.synchronize()
    held = accelerator.memory_stats()["allocated"] - variant["before_optimizer"]
    accelerator.reset_peak_memory_stats()
    loss, _ = train_step(variant["chunks"], variant["optimizer"], variant["batches"])
    accelerator.synchronize()
    return accelerator.memory_stats()["peak_allocated"], held, loss


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every variant; rows in :data:`VARIANTS` order."""
    from mindspeed.testing.megatron import train_step

    accelerator = get_accelerator()
    rows: dict[str, Row] = {}
    variants: dict[str, dict[str, Any]] = {}
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--only: unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    for name, (settings, overrides) in VARIANTS.items():
        if only and name != "none" and name not in only:
            continue
        variant = _build(args, settings, overrides)
        peak, held, loss = _peak_of_step(variant)
        rows[name] = Row(name, peak_mib=peak / 2**20, held_mib=held / 2**20, loss=loss)
        variants[name] = variant
    PARAMS["count"] = variants["none"]["params"]
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    started = time.perf_counter()
    for round_index in range(args.repeat):
        for name, variant in variants.items():
            accelerator.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            train_step(variant["chunks"], variant["optimizer"], variant["batches"])
            accelerator.synchronize()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        if round_index >= 1 and time.perf_counter() - started > args.budget_s:
            break
    base = rows["none"]
    for name, row in rows.items():
        row.step_ms, row.runs = statistics.median(times[name]) * 1e3, len(times[name])
        row.cpu_ms = statistics.median(cpu[name]) * 1e3
    for row in rows.values():
        row.peak_ratio, row.time_ratio = row.peak_mib / base.peak_mib, row.step_ms / base.step_ms
        row.cpu_ratio = row.cpu_ms / base.cpu_ms
    return list(rows.values())


#: Parameters of the benchmark's model (set by :func:`run`).
PARAMS: dict[str, int] = {}


def check_goals(rows: list[Row], params: int) -> list[tuple[str, str, bool]]:
    """The issue's goals: ``(goal, measured, met)``; times by CPU time (the wall time is in the table)."""
    by = {row.variant: row for row in rows}
    needed = (
        "none",
        "recompute_activation_function",
        "swap_attention",
        "reuse_fp32_param",
        "swap_optimizer (4 chunks)",
    )
    if any(name not in by for name in needed):
        return []
    none, reuse = by["none"], by["reuse_fp32_param"]
    swap = by["swap_optimizer (4 chunks)"]
    # The optimizer state of bf16 training with the distributed optimizer on one rank: the fp32
    # master and Adam's two fp32 moments, 12 bytes per parameter.
    state = 12 * params / 2**20
    freed = (none.held_mib - swap.held_mib) / state
    saved = (none.held_mib - reuse.held_mib) * 2**20 / params
    goals = []
    for name in ("recompute_activation_function", "swap_attention"):
        row = by[name]
        goals.append(
            (
                f"{name}: step time +<10 %",
                f"CPU {row.cpu_ratio - 1:+.1%}, wall {row.time_ratio - 1:+.1%}",
                row.cpu_ratio < 1.10,
            )
        )
    goals.append(
        (
            "swap_optimizer frees >=90 % of the optimizer state's device bytes",
            f"{freed:.1%} of 12 B x {params:,} = {state:.2f} MiB",
            freed >= 0.90,
        )
    )
    goals.append(
        (
            "reuse_fp32_param saves 2 B/param at +<2 % step time",
            f"{saved:.3f} B/param, CPU {reuse.cpu_ratio - 1:+.1%}, wall {reuse.time_ratio - 1:+.1%}",
            abs(saved - 2) < 0.1 and reuse.cpu_ratio < 1.02,
        )
    )
    return goals


def render(console: Console, title: str, rows: list[Row], record: _child.LoadRecord) -> str:
    """Print the table, one variant per line, with ratios to "none" (wall and CPU); its markdown."""
    columns = (
        "variant",
        "peak MiB",
        "peak / none",
        "held after step MiB",
        "wall ms",
        "wall / none",
        "CPU ms",
        "CPU / none",
        "loss (2nd step)",
        "runs",
    )
    cells = [
        (
            row.variant,
            f"{row.peak_mib:.2f}",
            f"{row.peak_ratio:.3f}x",
            f"{row.held_mib:.2f}",
            f"{row.step_ms:.1f}",
            f"{row.time_ratio:.2f}x",
            f"{row.cpu_ms:.1f}",
            f"{row.cpu_ratio:.2f}x",
            f"{row.loss:.6f}",
            str(row.runs),
        )
        for row in rows
    ]
    return _child.render(console, title, columns, cells, record, [row.variant == "none" for row in rows])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 160)
    accelerator = get_accelerator()
    with _child.one_megatron_rank():
        rows = run(args)
    title = (
        f"GPT training step (bf16, distributed optimizer, Adam) per memory feature: {args.layers} layers, "
        f"hidden {args.hidden}, ffn {args.ffn}, {args.microbatches} microbatches x {args.micro_batch_size} x "
        f"{args.seq} tokens, {accelerator.device()}, {torch.get_num_threads()} threads"
    )
    table = render(console, title, rows, record)
    console.print(f"{PARAMS['count']:,} parameters")
    goals = check_goals(rows, PARAMS["count"])
    for goal, measured, met in goals:
        console.print(f"{'met ' if met else 'MISSED'}  {goal}: {measured}")
    meta = _child.run_meta(
        args, record, params=PARAMS["count"], goals=[{"goal": g, "measured": m, "met": ok} for g, m, ok in goals]
    )
    _child.write_json(args.json, {"meta": meta, "rows": [asdict(row) for row in rows]}, console)
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    sys.exit(main())
