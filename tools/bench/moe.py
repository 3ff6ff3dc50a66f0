"""Benchmark one megatron-core MoE layer: sequential vs grouped experts, unfused vs fused permutation.

Builds megatron's ``MoELayer`` (alltoall dispatcher, one rank) with the same weights in each
variant and reports the median time of forward + backward and the peak memory one call adds,
with both ratios to the baseline (megatron's ``SequentialMLP`` and its own permute):

- ``sequential``: ``SequentialMLP``, a loop of per-expert MLPs (baseline);
- ``grouped``: ``RegistryGroupedMLP`` with the best ``grouped_matmul`` kernel here;
- ``grouped-loop``: ``RegistryGroupedMLP`` with the reference kernel (a per-expert loop), to
  separate the module's gain from the kernel's;
- ``+ fused permute``: the same with the dispatcher's permute/unpermute on the registry
  kernels (the ``moe_permute_fusion`` feature's patches).

Variants run round-robin, so a load change on the machine shifts all of them alike; the time is
given in wall and in CPU (process) time, each with its ratio. Usage::

    uv run --frozen python tools/bench/moe.py
    uv run --frozen python tools/bench/moe.py --tokens 4096 --hidden 512 --experts 16 --json moe.json
    uv run --frozen python tools/bench/moe.py --table moe.md   # refused (exit 2) on a busy machine
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MIB = float(1 << 20)
#: label -> (grouped experts, grouped_matmul impl, fused permutation)
VARIANTS = {
    "sequential": (False, None, False),
    "grouped": (True, "auto", False),
    "grouped-loop": (True, "reference", False),
    "sequential + fused permute": (False, None, True),
    "grouped + fused permute": (True, "auto", True),
}


@dataclass
class Row:
    """One variant's measurements."""

    variant: str
    experts_module: str = ""
    kernel: str = ""
    time_ms: float | None = None
    cpu_ms: float | None = None
    runs: int = 0
    peak_mib: float | None = None
    time_ratio: float | None = None
    cpu_ratio: float | None = None
    memory_ratio: float | None = None
    max_diff: float | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per call (sequence x batch)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--ffn", type=int, default=512, help="FFN width of each expert")
    parser.add_argument("--experts", type=int, default=8, help="routed experts")
    parser.add_argument("--topk", type=int, default=2, help="experts per token")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--budget-s", type=float, default=20.0, help="stop timing after about this many seconds")
    parser.add_argument("--json", default="", help="also write the measurements to this JSON file")
    _child.add_record_args(parser)
    return parser.parse_args(argv)


def _config(args: argparse.Namespace) -> Any:
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[args.dtype]
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        moe_ffn_hidden_size=args.ffn,
        num_attention_heads=max(1, args.hidden // 64),
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_te_activation_func=True,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _layer(config: Any, grouped: bool, impl: str | None, state: dict[str, torch.Tensor] | None) -> Any:
    from megatron.core.transformer.spec_utils import build_module

    from mindspeed.megatron.spec import get_gpt_layer_spec
    from mindspeed.testing.megatron import grouped_expert_state

    impls = {"swiglu": "auto", **({"grouped_matmul": impl} if impl else {})}
    spec = get_gpt_layer_spec(impls=impls, num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    layer = build_module(spec.submodules.mlp, config=config).to(get_accelerator().device())
    layer.set_layer_number(1)
    if state is not None:
        layer.load_state_dict(grouped_expert_state(state, config.num_moe_experts) if grouped else state)
    return layer


def _step(layer: Any, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad)
    return out.detach()


def _with_patches(fused: bool, fn: Callable[[], Any]) -> Any:
    from mindspeed.megatron.moe import moe_permute_patches
    from mindspeed.patching import PatchSet

    if not fused:
        return fn()
    patches = PatchSet(moe_permute_patches())
    patches.apply(get_accelerator())
    try:
        return fn()
    finally:
        patches.revert()


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every variant; returns one row each, the baseline first."""
    accelerator = get_accelerator()
    config = _config(args)
    device, dtype = accelerator.device(), DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(device, dtype)
    grad = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(device, dtype)
    baseline = _layer(config, False, None, None)
    state = {name: tensor for name, tensor in baseline.state_dict().items() if "_extra_state" not in name}
    layers = {
        label: baseline if label == "sequential" else _layer(config, grouped, impl, state)
        for label, (grouped, impl, _) in VARIANTS.items()
    }
    rows = {
        label: Row(label, type(layer.experts).__name__, getattr(getattr(layer.experts, "kernel", None), "name", "-"))
        for label, layer in layers.items()
    }
    calls = {
        label: (lambda layer=layer, fused=VARIANTS[label][2]: _with_patches(fused, lambda: _step(layer, x, grad)))
        for label, layer in layers.items()
    }
    reference = calls["sequential"]()  # also the warm-up of the baseline
    for label, call in calls.items():
        rows[label].max_diff = (call().float() - reference.float()).abs().max().item()
    times: dict[str, list[float]] = {label: [] for label in calls}
    cpu_times: dict[str, list[float]] = {label: [] for label in calls}
    started = time.perf_counter()
    for round_index in range(args.repeat):
        for label, call in calls.items():
            accelerator.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            call()
            accelerator.synchronize()
            times[label].append(time.perf_counter() - start)
            cpu_times[label].append(time.process_time() - cpu_start)
        if round_index >= 1 and time.perf_counter() - started > args.budget_s:
            break
    for label, call in calls.items():
        rows[label].time_ms, rows[label].runs = statistics.median(times[label]) * 1000.0, len(times[label])
        rows[label].cpu_ms = statistics.median(cpu_times[label]) * 1000.0
        with measure_peak_memory() as mem:
            call()
        rows[label].peak_mib = mem.peak_bytes / MIB
    base = rows["sequential"]
    for row in rows.values():
        row.time_ratio = row.time_ms / base.time_ms
        row.cpu_ratio = row.cpu_ms / base.cpu_ms if base.cpu_ms else None
        row.memory_ratio = row.peak_mib / base.peak_mib if base.peak_mib else None
    return list(rows.values())


def render(console: Console, title: str, rows: list[Row], record: _child.LoadRecord) -> str:
    """Print the table (time ratios in wall and CPU time to the sequential baseline); its markdown."""
    columns = (
        "variant",
        "experts",
        "kernel",
        "wall ms",
        "wall / seq",
        "CPU ms",
        "CPU / seq",
        "peak MiB",
        "mem / seq",
        "runs",
        "max |diff|",
    )
    cells = [
        (
            row.variant,
            row.experts_module,
            row.kernel,
            f"{row.time_ms:.1f}",
            f"{row.time_ratio:.2f}x",
            f"{row.cpu_ms:.1f}",
            "-" if row.cpu_ratio is None else f"{row.cpu_ratio:.2f}x",
            f"{row.peak_mib:.1f}",
            "-" if row.memory_ratio is None else f"{row.memory_ratio:.2f}x",
            str(row.runs),
            f"{row.max_diff:.1e}",
        )
        for row in rows
    ]
    return _child.render(console, title, columns, cells, record, [row.variant == "sequential" for row in rows], 3)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record = _child.LoadRecord(args.max_load)
    console = Console(width=None if sys.stdout.isatty() else 170)
    accelerator = get_accelerator()
    with _child.one_megatron_rank():  # megatron's MoE layer reads its process groups: one rank
        rows = run(args)
    title = (
        f"MoE layer fwd+bwd: {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts x ffn "
        f"{args.ffn}, top-{args.topk}, {args.dtype}, {accelerator.device()}, {torch.get_num_threads()} threads, "
        f"peak memory via {resolve_method()}"
    )
    table = render(console, title, rows, record)
    _child.write_json(
        args.json, {"meta": _child.run_meta(args, record), "rows": [asdict(row) for row in rows]}, console
    )
    return _child.finish(record, args.table, table)


if __name__ == "__main__":
    sys.exit(main())
