"""Benchmark the built-in inference engine against transformers' ``model.generate``.

Builds one random-weight Llama (default 4 layers, hidden 256, 8 heads in 4 kv groups, vocab 2048)
as a Hugging Face directory, loads it into both (fp32, the same device: ``--device``, default the CPU), and generates greedily
for the same random prompts at each batch size, the end-of-sequence token ignored so that every
request produces exactly ``--new-tokens`` tokens. transformers runs with its default attention
(SDPA) and dynamic KV cache; prompts in a batch have one length, so it needs no padding. Each
measurement is the best of ``--repeat`` runs after a warm-up run; the two are interleaved run by
run so that a noisy neighbour hits both alike. Wall time and CPU time (user + system of this
process: less sensitive to neighbours on a shared machine) are both reported. Both run with
``--threads`` intra-op threads (default 1: models this small gain nothing from more, and on a
busy machine a second thread mostly waits). It also checks that both produce the same tokens.
``--compile`` adds the engine with its decode step compiled (``compile=True``: one graph per batch
bucket, compiled in the warm-up run, whose seconds are reported) as rows of their own, named
``compile``, against the same transformers runs. ``--ab`` adds the compiled step without its CPU levers
(no prepacked weights, one step a graph call: the compiled step before them) as rows ``compile, plain``,
measured interleaved with the others, so the levers' gain is a ratio from one run.

Usage::

    uv run --frozen python tools/bench/generate.py
    uv run --frozen python tools/bench/generate.py --batch-sizes 1 8 32 --new-tokens 256 --json gen.json
    uv run --frozen python tools/bench/generate.py --compile      # also the compiled decode step
    uv run --frozen python tools/bench/generate.py --compile --ab # and the compiled step without its levers
    uv run --frozen python tools/bench/generate.py --table generate.md   # refused (exit 2) on a busy machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import _child  # tools/bench/_child.py: the script's folder is on sys.path

#: Row label after the batch size, per engine.
ENGINE_LABELS = {"eager": "", "compile": ", compile", "compile-plain": ", compile, plain"}


def build_model(path: Path, layers: int, hidden: int, vocab: int) -> None:
    """Save a random-weight Llama as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)


def timed(run) -> tuple[float, float, object]:
    """Wall seconds, CPU seconds and result of one call of ``run``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of both sides (default cpu; device_suite.py passes the accelerator's)",
    )
    parser.add_argument("--compile", action="store_true", help="also the engine with its decode step compiled")
    parser.add_argument(
        "--ab", action="store_true", help="with --compile: also the compiled step without prepacking and chunks"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    _child.add_record_args(parser)
    args = parser.parse_args()
    record = _child.LoadRecord(args.max_load)

    import torch
    from transformers import AutoModelForCausalLM

    from mindspeed.compile import CompileWatch
    from mindspeed_llm.inference import InferenceEngine, SamplingParams
    from mindspeed_llm.inference.compiled import CompiledDecode

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.layers, args.hidden, args.vocab)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(args.device).eval()
        ours = InferenceEngine.from_pretrained(
            tmp, dtype="float32", max_batch_size=max(args.batch_sizes), device=args.device
        )
        compiled = (
            InferenceEngine.from_pretrained(
                tmp, dtype="float32", max_batch_size=max(args.batch_sizes), device=args.device, compile=True
            )
            if args.compile
            else None
        )
        plain = None
        if compiled is not None and args.ab:
            plain = InferenceEngine.from_pretrained(
                tmp, dtype="float32", max_batch_size=max(args.batch_sizes), device=args.device
            )
            plain.compiled = CompiledDecode(plain.model, max(args.batch_sizes), prepack=False, chunk=1)
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        generator = torch.Generator().manual_seed(1)
        for batch in args.batch_sizes:
            prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=generator)
            load_before = _child.load_average()

            def run_hf():
                with torch.inference_mode():
                    out = hf.generate(
                        prompts.to(args.device),
                        attention_mask=torch.ones_like(prompts).to(args.device),
                        do_sample=False,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        pad_token_id=0,
                    )
                return out[:, args.prompt_len :].tolist()

            def run_ours():
                return [o.token_ids for o in ours.generate(prompts.tolist(), params)]

            def run_compiled():
                return [o.token_ids for o in compiled.generate(prompts.tolist(), params)]

            def run_plain():
                return [o.token_ids for o in plain.generate(prompts.tolist(), params)]

            sides = {"hf": run_hf, "ours": run_ours} | ({"compile": run_compiled} if compiled else {})
            sides |= {"compile-plain": run_plain} if plain else {}
            watch = CompileWatch()
            compile_wall, _, _ = timed(run_compiled) if compiled else (0.0, 0.0, None)  # compiles this batch's graphs
            graphs, compile_s = watch.graphs(), watch.seconds()
            run_hf(), run_ours()  # warm-up
            if plain:
                run_plain()
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
            tokens: dict[str, object] = {}
            after = CompileWatch()
            for _ in range(args.repeat):  # interleaved: a noisy neighbour slows all alike
                for name, run in sides.items():
                    wall, cpu, tokens[name] = timed(run)
                    times[name].append((wall, cpu))
            generated = batch * args.new_tokens
            load_around = [load_before, _child.load_average()]
            for side in [s for s in sides if s != "hf"]:
                row = {
                    "engine": {"ours": "eager"}.get(side, side),
                    "batch": batch,
                    "new_tokens": args.new_tokens,
                    "prompt_len": args.prompt_len,
                    "same_tokens": tokens["hf"] == tokens[side],
                }
                for name, who in (("hf", "hf"), (side, "ours")):
                    row[f"{who}_wall_tok_s"] = generated / min(w for w, _ in times[name])
                    row[f"{who}_cpu_tok_s"] = generated / min(c for _, c in times[name])
                row["speedup_wall"] = row["ours_wall_tok_s"] / row["hf_wall_tok_s"]
                row["speedup_cpu"] = row["ours_cpu_tok_s"] / row["hf_cpu_tok_s"]
                if side == "compile":
                    # the warm-up call that compiled (wall), dynamo + Inductor seconds, graphs; none after it
                    row["compile"] = {"first_call_s": compile_wall, "compile_s": compile_s, "graphs": graphs}
                    row["graphs_after_warmup"] = after.graphs()
                row["load_around"] = load_around
                row["noisy"] = record.noisy([row])
                rows.append(row)

    noisy = any(row["noisy"] for row in rows)
    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); model: Llama {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}, fp32; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, eos ignored; "
        f"best of {args.repeat}; {record.header(noisy)}"
    )
    columns = (
        "batch",
        "HF tok/s wall",
        "engine",
        "speedup (wall)",
        "HF tok/s CPU",
        "engine",
        "speedup (CPU)",
        "same tokens",
        "load",
    )
    cells = [
        (
            _child.mark(f"{row['batch']}{ENGINE_LABELS[row['engine']]}", row["noisy"]),
            f"{row['hf_wall_tok_s']:.0f}",
            f"{row['ours_wall_tok_s']:.0f}",
            f"{row['speedup_wall']:.2f}x",
            f"{row['hf_cpu_tok_s']:.0f}",
            f"{row['ours_cpu_tok_s']:.0f}",
            f"{row['speedup_cpu']:.2f}x",
            str(row["same_tokens"]),
            f"{row['load_around'][0]:.1f}-{row['load_around'][1]:.1f}",
        )
        for row in rows
    ]
    compiled_rows = [row for row in rows if row["engine"] == "compile"]
    if compiled_rows:
        header += "; compile: " + ", ".join(
            f"batch {r['batch']} {r['compile']['graphs']} graph(s) in {r['compile']['compile_s']:.0f} s "
            f"(first call {r['compile']['first_call_s']:.0f} s), {r['graphs_after_warmup']} after warm-up"
            for r in compiled_rows
        )
    table = _child.markdown(header, columns, cells)
    sys.stdout.write(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return record.write_table(args.table, table, noisy)


if __name__ == "__main__":
    sys.exit(main())
