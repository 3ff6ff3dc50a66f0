"""The accelerator suite: one command, one table of MFU and of our ratios against the peers.

Parts (each reuses a bench of this folder; nothing here re-implements a side):

- ``pretrain_mfu``: MFU of our pretrain step (``pretrain.py``'s ``prepare`` and ``ours``
  children) on a ~1 B Llama (``pretrain.py --size 1b``: 22 layers, hidden 2048, TinyLlama's
  shape; the demo tokenizer's padded vocabulary), bf16 on an accelerator, the registry's kernels
  as ``features.optimization_level`` 2 resolves them, each ``TransformerLayer`` compiled
  (``train.compile``, compiled in the untimed first steps; eager in a ``--dry-run``). MFU = measured tokens/s x
  :func:`mindspeed.metrics.flops.training_flops_per_token` / the device's dense peak
  (:mod:`mindspeed.metrics.peak`'s table by device name, or ``--peak-tflops``);
- ``vlm``: ``vlm.py`` (ours vs Hugging Face ``Trainer``, full fine-tuning), tokens/s ratio;
- ``dit``: ``dit.py --parts 1`` (ours, compiled blocks, vs the diffusers loop), step-rate ratio;
- ``generate``: ``generate.py`` (our engine vs transformers' ``generate``), tokens/s ratio per batch;
- ``grpo``: ``grpo.py --no-buffer-modes`` (our step vs TRL's ``GRPOTrainer``), step-rate ratio.

``generate.py`` runs both sides on the accelerator (its ``--device``, fp32). ``vlm.py``, ``dit.py``
and ``grpo.py`` are CPU benches as of this writing (fp32, both sides on the host): on an
accelerator host they still measure the host, and their rows say ``cpu`` in the device column.
``--dry-run`` runs every part at its smallest size on the CPU (fp32 for the MFU part), so that
the script cannot rot; its numbers mean nothing. Usage::

    uv run --frozen python tools/bench/device_suite.py                   # on a CUDA / NPU host, < 8 min
    uv run --frozen python tools/bench/device_suite.py --peak-tflops 313 # a device not in the table
    uv run --frozen python tools/bench/device_suite.py --dry-run --json rows.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import pretrain


@dataclass(frozen=True)
class Part:
    """One part of the suite: what it measures, its goal, and the function that runs it.

    ``run(args, work)`` returns rows: ``{"row", "value", "unit", "device"}`` plus an optional ``note``.
    """

    what: str
    goal: str
    run: Callable[[argparse.Namespace, Path], list[dict[str, Any]]]


# ----------------------------------------------------------------------------- parts


def pretrain_mfu(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """MFU of our pretrain step (pretrain.py's children), from its timed loop periods."""
    from mindspeed.device import get_accelerator

    device = get_accelerator().name
    dry = args.dry_run or device == "cpu"
    precision = "fp32" if device == "cpu" else "bf16"
    size = {"size": "tiny", "steps": 4, "micro_batch": 2, "seq_length": 32} if args.dry_run else {}
    if device == "cpu" and not args.dry_run:  # a 1 B model in fp32 on a host would take hours
        size = {"size": "small", "micro_batch": 8, "seq_length": 128}
    spec = {
        "workdir": str(work / "pretrain"),
        **{"size": "1b", "steps": 8, "micro_batch": 4, "seq_length": 2048, **size},
        "warmup": 1 if args.dry_run else 3,
        "grad_accum": 1,
        "threads": 2 if dry else 8,
        "level": 2,
        "precision": precision,
        "compile": not args.dry_run,
    }
    Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
    spec.update(pretrain.run_child("prepare", spec, work / "pretrain_prepare.log"))
    run = pretrain.run_child("ours", spec, work / "pretrain_ours.log")
    shape, tokens_per_s, flops, peak, value = measure_mfu(spec, run["periods"], args.peak_tflops)
    note = (
        f"{spec['size']} Llama {shape.num_layers} layers, hidden {shape.hidden_size}, seq {spec['seq_length']}, "
        f"micro batch {spec['micro_batch']}, {precision}, "
        f"{'compiled layers' if spec['compile'] else 'eager layers (dry run)'}; "
        f"{tokens_per_s:,.0f} tokens/s, {flops / 1e12:.3g} TFLOP/s; peak "
        f"{peak.describe() if peak else 'unknown: pass --peak-tflops'}"
    )
    return [
        {
            "row": "pretrain MFU",
            "value": None if value is None else 100 * value,
            "unit": "% MFU",
            "device": device,
            "note": note,
        }
    ]


def measure_mfu(spec: dict[str, Any], periods: Sequence[float], peak_tflops: float | None) -> tuple[Any, ...]:
    """The model shape of ``spec``'s run, its tokens/s and model FLOP/s over the median step of
    ``periods``, the device's peak and the MFU (``None`` without a peak)."""
    from mindspeed.metrics.flops import training_flops_per_token
    from mindspeed.metrics.peak import mfu, peak_flops

    config = pretrain.load_config(spec, spec["steps"], spec["level"])
    shape = config.model.to_shape(spec["vocab_size"], spec["seq_length"], spec["precision"])
    tokens_per_s = spec["micro_batch"] * spec["grad_accum"] * spec["seq_length"] / statistics.median(periods)
    flops = training_flops_per_token(shape, spec["seq_length"]) * tokens_per_s
    peak = peak_flops(spec["precision"], peak_tflops)
    return shape, tokens_per_s, flops, peak, mfu(flops, peak, 1)


def vlm_argv(dry_run: bool) -> list[str]:
    """vlm.py's arguments: full fine-tuning only; its ``--quick`` size, or the smallest for a dry run."""
    small = ["--size", "tiny", "--steps", "4", "--warmup", "1", "--micro-batch", "1", "--grad-accum", "1"]
    return ["--variants", "full", *(small + ["--repeats", "1"] if dry_run else ["--quick"])]


def vlm_ratio(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Our Qwen2.5-VL full fine-tuning step vs Hugging Face Trainer (vlm.py), tokens/s."""
    argv = [*vlm_argv(args.dry_run), "--workdir", str(work / "vlm")]
    ours, hf = list(_child.run_bench("vlm.py", argv, work)["results"].values())[:2]
    return [_ratio_row("VLM full step vs HF Trainer", ours["tokens_per_s"] / hf["tokens_per_s"], "tokens/s")]


def dit_argv(dry_run: bool) -> list[str]:
    """dit.py's arguments: part 1 only; ``--quick``, or the smallest video and eager blocks for a dry run."""
    if not dry_run:
        return ["--parts", "1", "--quick"]
    return [
        *("--parts", "1", "--repeats", "1", "--steps", "4", "--warmup", "1", "--micro-batch", "1"),
        *("--grad-accum", "1", "--shape", "16,1,8,8", "--text-len", "8", "--compile", "false"),
    ]


def dit_ratio(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Our Wan DiT step (compiled blocks; eager in a dry run) vs the diffusers loop (dit.py part 1)."""
    argv = [*dit_argv(args.dry_run), "--workdir", str(work / "dit")]
    ours, ref = _child.run_bench("dit.py", argv, work)["part1"]["results"].values()
    mode = "eager (dry run)" if args.dry_run else "compiled blocks"
    return [_ratio_row(f"DiT step ({mode}) vs diffusers loop", ref["step_s"] / ours["step_s"], "steps/s")]


def generate_argv(dry_run: bool) -> list[str]:
    """generate.py's arguments: its default model and batches 1 and 8, or a one-layer model for a dry run."""
    if not dry_run:
        return ["--repeat", "2", "--device", _device()]
    return [
        *("--layers", "1", "--hidden", "64", "--vocab", "128", "--prompt-len", "4", "--new-tokens", "4"),
        *("--batch-sizes", "1", "--repeat", "1"),
    ]


def _device() -> str:
    """The accelerator's torch device (``cpu`` without one)."""
    from mindspeed.device import get_accelerator

    return str(get_accelerator().device())


def generate_ratio(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Our inference engine vs transformers' generate (generate.py), tokens/s per batch size."""
    return [
        {
            **_ratio_row(f"generate batch {r['batch']} vs transformers", r["speedup_wall"], "tokens/s"),
            "device": "cpu" if args.dry_run else _device(),
            "note": f"fp32; same tokens {r['same_tokens']}",
        }
        for r in _child.run_bench("generate.py", generate_argv(args.dry_run), work)
    ]


def grpo_argv(dry_run: bool) -> list[str]:
    """grpo.py's arguments: the TRL comparison only (no Ray buffer modes); ``--quick``, or a 2-layer
    model, one prompt x 2 responses of 4 tokens for a dry run."""
    if not dry_run:
        return ["--no-buffer-modes", "--quick"]
    return [
        *("--no-buffer-modes", "--size", "micro", "--steps", "2", "--warmup", "1", "--global-batch", "1"),
        *("--n", "2", "--micro-batch", "2", "--max-new-tokens", "4", "--repeats", "1"),
    ]


def grpo_ratio(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Our GRPO step vs TRL's GRPOTrainer (grpo.py, sync), step rate."""
    argv = [*grpo_argv(args.dry_run), "--workdir", str(work / "grpo")]
    results = _child.run_bench("grpo.py", argv, work)["results"]
    return [_ratio_row("GRPO step vs TRL", results["trl"]["step_s"] / results["ours"]["step_s"], "steps/s")]


#: The benches the ratio parts run, and their arguments (dry run or not); a test parses them.
BENCH_ARGV: dict[str, tuple[str, Callable[[bool], list[str]]]] = {
    "vlm": ("vlm.py", vlm_argv),
    "dit": ("dit.py", dit_argv),
    "generate": ("generate.py", generate_argv),
    "grpo": ("grpo.py", grpo_argv),
}


def _ratio_row(row: str, ratio: float, per: str, note: str = "") -> dict[str, Any]:
    """A ratio row of a CPU bench (the device column says where it was measured)."""
    return {"row": row, "value": ratio, "unit": f"x peer ({per}, wall)", "device": "cpu", "note": note}


#: The parts, in the order they run. Extend by adding an entry.
PARTS: dict[str, Part] = {
    "pretrain_mfu": Part("~1B Llama pretrain step, one device", "MFU >= 50 % on H100/H200", pretrain_mfu),
    "vlm": Part("Qwen2.5-VL full fine-tuning step", ">= 1.5x HF Trainer", vlm_ratio),
    "dit": Part("Wan DiT training step", ">= 1.2x the diffusers loop", dit_ratio),
    "generate": Part("greedy generation", ">= 2x transformers", generate_ratio),
    "grpo": Part("GRPO step (sync)", ">= 1.5x TRL", grpo_ratio),
}


# ----------------------------------------------------------------------------- driver


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every part at its smallest size (CPU, < 1 min)")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="peak TFLOP/s of one device (default: the table by device name)"
    )
    parser.add_argument(
        "--parts", nargs="+", default=list(PARTS), help=f"parts to run (default all: {' '.join(PARTS)})"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--workdir", default=None, help="benches' files and logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts {' '.join(unknown)}: unknown; the parts are {', '.join(PARTS)}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops={args.peak_tflops} must be positive")
    return args


def run_parts(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every chosen part in turn; a part that fails gives a row with its error (the others still run)."""
    rows = []
    for name in args.parts:
        part, started = PARTS[name], time.perf_counter()
        try:
            got = part.run(args, work)
        except Exception as err:  # one broken bench must not hide the others' numbers
            got = [{"row": part.what, "value": None, "unit": "", "device": "-", "note": f"failed: {err}"}]
        wall = time.perf_counter() - started
        rows += [{"part": name, "what": part.what, "goal": part.goal, "wall_s": wall, **row} for row in got]
    return rows


def table(rows: list[dict[str, Any]], header: str) -> str:
    """The markdown table of the rows."""
    columns = ("part", "row", "value", "unit", "goal", "device", "wall s", "note")
    cells = [
        (
            r["part"],
            r["row"],
            "-" if r["value"] is None else f"{r['value']:.2f}",
            r["unit"],
            r["goal"],
            r["device"],
            f"{r['wall_s']:.0f}",
            r.get("note", ""),
        )
        for r in rows
    ]
    return _child.markdown(header, columns, cells)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite, print the table, write ``--json``; exit status 1 when a part failed."""
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="device-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    from mindspeed.device import get_accelerator
    from mindspeed.metrics.peak import device_name

    started, load = time.perf_counter(), _child.load_average()
    rows = run_parts(args, work)
    header = (
        f"device suite{' (dry run: sizes mean nothing)' if args.dry_run else ''} on {get_accelerator().name} "
        f"({device_name()}); {time.perf_counter() - started:.0f} s; load average {load:.1f} -> "
        f"{_child.load_average():.1f}; logs in {work}"
    )
    sys.stdout.write(table(rows, header))
    if args.json:
        _child.write_json(args.json, {"header": header, "rows": rows})
    return 1 if any(r["note"].startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
