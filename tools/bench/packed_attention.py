"""Packed (THD) attention on SDPA: the dense block-diagonal mask against the segment-wise path.

For each packing (``segments x mean length``) this times one attention call's forward +
backward on a packed row ``[1, tokens, heads, dim]`` three ways, in one process:

- ``dense``: ``attention_sdpa`` forced onto one ``[tokens, tokens]`` block-diagonal mask;
- ``segmented``: ``attention_sdpa`` as it runs by default (segments batched by length);
- ``loop``: one plain ``is_causal`` SDPA call per segment (the lower bound without batching);

and reports the best of ``--repeat`` runs in milliseconds (the minimum: on a shared machine
the other processes only ever add time) and ``dense / segmented``, in wall and in CPU time. It also checks that the two
``attention_sdpa`` paths agree (outputs and gradients) before timing them.

Usage::

    uv run --frozen python tools/bench/packed_attention.py
    uv run --frozen python tools/bench/packed_attention.py --shapes 8x82,64x16 --spread 0 --repeat 20
    uv run --frozen python tools/bench/packed_attention.py --window 63   # a sliding window
    uv run --frozen python tools/bench/packed_attention.py --table packed.md   # refused (exit 2) on a busy machine
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import torch
import torch.nn.functional as F
from rich.console import Console

from mindspeed.ops import attention as attention_module

DEFAULT_SHAPES = "8x82,32x40,2x512,64x16"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of SEGMENTSxMEAN_LENGTH")
    parser.add_argument("--hidden", type=int, default=256, help="model width (heads x head dim)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument(
        "--spread",
        type=float,
        default=0.25,
        help="segment lengths are drawn uniformly within +-spread of the mean (0: equal)",
    )
    parser.add_argument("--window", type=int, default=0, help="sliding window in tokens (0: plain causal)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    _child.add_record_args(parser)
    return parser.parse_args(argv)


def segment_lengths(count: int, mean: int, spread: float, gen: torch.Generator) -> list[int]:
    """``count`` lengths within ``mean * (1 +- spread)``, at least 1 each."""
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


def time_calls(
    fns: dict[str, Callable[[], torch.Tensor]], grad: torch.Tensor, warmup: int, repeat: int
) -> dict[str, float]:
    """Best (minimum) milliseconds of each ``fn()`` forward + backward over ``repeat`` runs, in wall
    time (``name``) and in CPU time of the process (``name + "_cpu"``).

    The functions take turns, so that a burst of load from other processes hits them alike.
    """
    times: dict[str, list[float]] = {key: [] for name in fns for key in (name, f"{name}_cpu")}
    for step in range(warmup + repeat):
        for name, fn in fns.items():
            started, cpu = time.perf_counter(), time.process_time()
            fn().backward(grad)
            if step >= warmup:
                times[name].append((time.perf_counter() - started) * 1e3)
                times[f"{name}_cpu"].append((time.process_time() - cpu) * 1e3)
    return {name: min(values) for name, values in times.items()}


def bench_shape(lengths: list[int], args: argparse.Namespace, gen: torch.Generator) -> dict[str, Any]:
    """Time dense, segmented and loop on one packing; raise if the two sdpa paths disagree."""
    tokens, dim = sum(lengths), args.hidden // args.heads
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)
    window = (args.window - 1, 0) if args.window > 0 else (-1, -1)
    q = torch.randn(1, tokens, args.heads, dim, generator=gen).requires_grad_(True)
    k, v = (torch.randn(1, tokens, args.kv_heads, dim, generator=gen).requires_grad_(True) for _ in range(2))
    grad = torch.randn(q.shape, generator=gen)

    def sdpa(dense: bool) -> torch.Tensor:
        saved = attention_module._DENSE_COST
        # A huge dense weight makes the cost estimate always pick the segments; 0, the dense mask.
        attention_module._DENSE_COST = 1e30 if not dense else 0.0
        try:
            return attention_module.attention_sdpa(q, k, v, window_size=window, cu_seqlens=cu)
        finally:
            attention_module._DENSE_COST = saved

    def loop() -> torch.Tensor:
        pieces = []
        for start, end in zip(bounds, bounds[1:]):
            part = [x[:, start:end].transpose(1, 2) for x in (q, k, v)]
            pieces.append(F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True).transpose(1, 2))
        return torch.cat(pieces, dim=1)

    results = {}
    for name, dense in (("dense", True), ("segmented", False)):
        for x in (q, k, v):
            x.grad = None
        out = sdpa(dense)
        out.backward(grad)
        results[name] = [out.detach()] + [x.grad.clone() for x in (q, k, v)]
    error = max(float((a - b).abs().max()) for a, b in zip(results["dense"], results["segmented"]))
    if error > 1e-4:
        raise RuntimeError(f"dense and segmented disagree by {error:.2e} on lengths {lengths}")
    fns = {"dense": lambda: sdpa(True), "segmented": lambda: sdpa(False)}
    if args.window <= 0:
        fns["loop"] = loop
    times: dict[str, Any] = {**time_calls(fns, grad, args.warmup, args.repeat), "max_error": error}
    # Which path attention_sdpa's cost model takes by default.
    calls = attention_module._CALL_COST / (args.heads * dim)
    groups = attention_module._segment_groups(bounds, calls)
    segmented = attention_module._segmented_cost(bounds, groups, calls) < attention_module._DENSE_COST * tokens**2
    times["auto"] = f"segmented ({len(groups)} calls)" if segmented else "dense"
    return times


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 170)
    title = (
        f"packed causal attention, fwd+bwd ms, best of {args.repeat} (hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, fp32, "
        f"{args.threads} thread{'s' if args.threads > 1 else ''}, spread {args.spread}"
        f"{f', window {args.window}' if args.window > 0 else ''})"
    )
    columns = (
        "packing",
        "tokens",
        "dense",
        "segmented",
        "loop",
        "dense / segmented",
        "CPU ms dense / segmented",
        "CPU dense / segmented",
        "max |diff|",
        "default path",
    )
    rows = []
    for shape in args.shapes.split(","):
        count, mean = (int(part) for part in shape.lower().split("x"))
        lengths = segment_lengths(count, mean, args.spread, gen)
        times = bench_shape(lengths, args, gen)
        loop = f"{times['loop']:.2f}" if "loop" in times else "-"
        rows.append(
            (
                f"{count} x {mean}",
                str(sum(lengths)),
                f"{times['dense']:.2f}",
                f"{times['segmented']:.2f}",
                loop,
                f"{times['dense'] / times['segmented']:.2f}x",
                f"{times['dense_cpu']:.2f} / {times['segmented_cpu']:.2f}",
                f"{times['dense_cpu'] / times['segmented_cpu']:.2f}x",
                f"{times['max_error']:.1e}",
                times["auto"],
            )
        )
    table = _child.render(console, title, columns, rows, record)
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    sys.exit(main())
