"""Benchmark ``mindspeed-llm convert-ckpt`` against the I/O floor on a generated ~1 GB model.

Generates a Llama-style checkpoint (bf16, random weights, safetensors shards of
``--shard-size``), then runs, each in a fresh process so that its peak RSS is its own, and
each after the same imports (torch, safetensors, transformers' config classes, mindspeed_llm),
so that times and memory are those of the work, not of Python start-up:

- an interpreter that only does the imports (the RSS every step starts from);
- the I/O floor: a plain safetensors read + write of the same shards (``load_file`` then
  ``save_file``, shard by shard);
- ``convert-ckpt`` hf -> mg at ``--tp``/``--pp``;
- ``convert-ckpt`` mg -> hf back (shards of ``--shard-size``).

It prints the time of the work, its CPU seconds (user + system of all threads: less sensitive
than wall time to neighbours on a shared machine), the peak RSS of each, the
ratios to the floor, and the
peak RSS above the imports-only interpreter next to the largest output file (the goal:
conversion within 1.5x of the floor's time, memory under 2x the largest output shard). Every
step runs ``--repeat`` times in one invocation and its fastest run counts (the peak RSS is the
largest seen); the source files are in the page cache for every step, the floor included.

Every step starts from the same state: after the imports and just before its timer, it removes
its own previous output (and nothing else) and flushes the dirty pages (``os.sync``). The
earlier order removed ``back`` and ``mg`` (2.3 GB) right before hf -> mg and nothing before
mg -> hf, and let each step inherit the previous steps' unwritten 1.15 GB: mg -> hf, the third
writer in a row, started with the most dirty pages (the kernel throttles writers past its dirty
limit: wall time, not CPU time) and without freed pages to write into (on this VM, which returns
free memory to its host about 2 s after it is freed, writing 600 MB into pages freed moments
ago took 0.16-0.19 CPU s, into pages freed 8 s before 1.33-1.46 CPU s): the likely reason it
measured 1.87-2.05x the floor on a quiet machine and hf -> mg 0.48-0.82x (docs/llm/convert-ckpt.md).

The load average is recorded around every run: a step that saw a busy machine (``--max-load``,
default cores + 1) is marked noisy, and ``--table FILE`` (the table for the docs) refuses to
write from a busy run (exit status 2).

Usage::

    uv run --frozen python tools/bench/convert.py
    uv run --frozen python tools/bench/convert.py --layers 4 --tp 2 --pp 2 --json convert.json
    uv run --frozen python tools/bench/convert.py --table convert.md   # refused (exit 2) on a busy machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import _child  # tools/bench/_child.py (no torch: the parent stays small)

MB = 1e6
#: Done before the timer starts in every step (transformers' config modules load lazily: seconds).
IMPORTS = (
    "import sys, time, json; import torch, safetensors.torch; from transformers import AutoConfig, LlamaConfig; "
    "import mindspeed_llm.cli\n"
)


def generate(path: Path, layers: int, shard_bytes: int) -> int:
    """Write a Llama-style bf16 checkpoint; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, heads, groups, ffn, vocab = 2048, 16, 4, 5504, 32000
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        vocab_size=vocab,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    config.save_pretrained(path)
    kv = hidden // heads * groups
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in shapes.items():
        tensor = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def measure(work: str, output: Path | None = None, make: bool = False) -> tuple[float, float, float]:
    """Seconds of ``work``, peak RSS (MB) of the process and CPU seconds of ``work`` (user +
    system, all threads) in a fresh process that does :data:`IMPORTS` first, then removes
    ``output`` (and with ``make`` creates it empty) and flushes dirty pages before the timer starts.

    The parent stays small (no torch): a child's peak RSS counts what it inherits at fork.
    """
    clear = ""
    if output is not None:
        clear = f"import os, shutil; shutil.rmtree({str(output)!r}, ignore_errors=True)\n"
        clear += f"os.makedirs({str(output)!r})\n" if make else ""
    clear += "import os; os.sync()\n"
    code = (
        IMPORTS
        + clear
        + "start, cpu = time.perf_counter(), time.process_time()\n"
        + work
        + "\nprint(json.dumps([time.perf_counter() - start, time.process_time() - cpu]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"step failed ({status}): {work[:200]}")
    wall, cpu = json.loads(out.decode().strip().splitlines()[-1])
    return wall, usage.ru_maxrss * 1024 / MB, cpu  # ru_maxrss: KiB on Linux


def largest_file(path: Path, pattern: str) -> float:
    """Size in MB of the largest file under ``path`` matching ``pattern``."""
    return max(f.stat().st_size for f in path.rglob(pattern)) / MB


def main() -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10, help="decoder layers (10: about 1.15 GB in bf16)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--shard-size", default="500MB", help="safetensors shard size of source and output")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per step; the fastest counts (a shared machine's page cache and neighbours make single runs noisy)",
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    _child.add_record_args(parser)
    parser.add_argument("--generate", default=None, help=argparse.SUPPRESS)  # internal: the generator child
    args = parser.parse_args()
    shard_bytes = int(float(args.shard_size.upper().removesuffix("MB")) * MB)
    if args.generate:
        sys.stdout.write(json.dumps(generate(Path(args.generate), args.layers, shard_bytes)) + "\n")
        return 0
    record = _child.LoadRecord(args.max_load)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    root.mkdir(parents=True, exist_ok=True)
    hf, floor_out, mg, back = root / "hf", root / "floor", root / "mg", root / "back"
    for path in (hf, floor_out, mg, back):
        shutil.rmtree(path, ignore_errors=True)
    hf.mkdir()
    # In a child: the parent must stay small (see measure()).
    total = json.loads(
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--generate",
                str(hf),
                "--layers",
                str(args.layers),
                "--shard-size",
                args.shard_size,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    steps = {
        "interpreter (imports only)": "pass",
        "I/O floor: safetensors read + write": (
            "from pathlib import Path; from safetensors.torch import load_file, save_file\n"
            f"for f in sorted(Path({str(hf)!r}).glob('*.safetensors')):\n"
            f"    save_file(load_file(f), Path({str(floor_out)!r}) / f.name, metadata={{'format': 'pt'}})"
        ),
        f"convert-ckpt hf -> mg (TP{args.tp} PP{args.pp})": (
            "from mindspeed_llm.cli import main; assert main(['convert-ckpt', '--load-dir', "
            f"{str(hf)!r}, '--save-dir', {str(mg)!r}, '--target-tensor-parallel-size', '{args.tp}', "
            f"'--target-pipeline-parallel-size', '{args.pp}', '--no-progress']) == 0"
        ),
        "convert-ckpt mg -> hf": (
            "from mindspeed_llm.cli import main; assert main(['convert-ckpt', '--load-model-type', 'mg', "
            f"'--save-model-type', 'hf', '--load-dir', {str(mg)!r}, '--save-dir', {str(back)!r}, "
            f"'--max-shard-size', {args.shard_size!r}, '--no-progress']) == 0"
        ),
    }
    outputs = {
        "I/O floor: safetensors read + write": floor_out,
        f"convert-ckpt hf -> mg (TP{args.tp} PP{args.pp})": mg,
        "convert-ckpt mg -> hf": back,
    }
    results, loads = {}, {}
    for _ in range(args.repeat):
        for name, code in steps.items():
            if name == "convert-ckpt mg -> hf" and not (mg / "latest_checkpointed_iteration.txt").is_file():
                continue
            before = _child.load_average()
            wall, rss, cpu = measure(code, outputs.get(name), make=name.startswith("I/O"))
            loads.setdefault(name, []).append({"load_around": [before, _child.load_average()]})
            best = results.get(name)
            results[name] = (min(wall, best[0]), max(rss, best[1]), min(cpu, best[2])) if best else (wall, rss, cpu)
    base_rss = results["interpreter (imports only)"][1]
    floor_time, _, floor_cpu = results["I/O floor: safetensors read + write"]
    largest = {
        "I/O floor: safetensors read + write": largest_file(floor_out, "*.safetensors"),
        f"convert-ckpt hf -> mg (TP{args.tp} PP{args.pp})": largest_file(mg, "*.pt"),
        "convert-ckpt mg -> hf": largest_file(back, "*.safetensors"),
    }
    rows, noisy = [], any(record.noisy(runs) for runs in loads.values())
    lines = [
        f"model: {total / 1e9:.3f} GB of tensors (bf16, {args.layers} layers), fastest of {args.repeat} run(s); "
        f"{record.header(noisy)}; {root}\n\n",
        "| step | work s | time / floor | work CPU s | CPU / floor | peak RSS MB | RSS above interpreter MB "
        "| largest output file MB | RSS above interpreter / largest file | load |\n",
        "|---|---|---|---|---|---|---|---|---|---|\n",
    ]
    for name, (wall, rss, cpu) in results.items():
        big = largest.get(name)
        above, work_cpu = rss - base_rss, cpu
        row = {
            "step": name,
            "wall_s": round(wall, 2),
            "time_ratio": round(wall / floor_time, 2),
            "cpu_s": round(work_cpu, 2),
            "cpu_ratio": round(work_cpu / floor_cpu, 2),
            "peak_rss_mb": round(rss),
            "rss_above_interpreter_mb": round(above),
            "largest_output_mb": round(big) if big else None,
            "rss_ratio": round(above / big, 2) if big else None,
            "load": _child.load_range(loads[name]),
            "noisy": record.noisy(loads[name]),
        }
        rows.append(row)
        lines.append(
            f"| {_child.mark(name, row['noisy'])} | {wall:.2f} | {wall / floor_time:.2f} | {work_cpu:.2f} "
            f"| {work_cpu / floor_cpu:.2f} | {rss:.0f} | {above:.0f} | {f'{big:.0f}' if big else '-'} "
            f"| {f'{above / big:.2f}' if big else '-'} | {row['load'][0]:.1f}-{row['load'][1]:.1f} |\n"
        )
    table = "".join(lines)
    sys.stdout.write(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"model_bytes": total, "rows": rows}, indent=2))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return record.write_table(args.table, table, noisy)


if __name__ == "__main__":
    sys.exit(main())
