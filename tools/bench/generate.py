"""Benchmark the built-in inference engine against transformers' ``model.generate``.

Builds one random-weight Llama (default 4 layers, hidden 256, 8 heads in 4 kv groups, vocab 2048)
as a Hugging Face directory, loads it into both (fp32, the same device), and generates greedily
for the same random prompts at each batch size, the end-of-sequence token ignored so that every
request produces exactly ``--new-tokens`` tokens. transformers runs with its default attention
(SDPA) and dynamic KV cache; prompts in a batch have one length, so it needs no padding. Each
measurement is the best of ``--repeat`` runs after a warm-up run; the two are interleaved run by
run so that a noisy neighbour hits both alike. It also checks that both produce the same tokens.

Usage::

    uv run --frozen python tools/bench/generate.py
    uv run --frozen python tools/bench/generate.py --batch-sizes 1 8 32 --new-tokens 256 --json gen.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def build_model(path: Path, layers: int, hidden: int, vocab: int) -> None:
    """Save a random-weight Llama as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=4096,
                         architectures=["LlamaForCausalLM"], eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)


def best_of(run, repeat: int) -> tuple[float, object]:
    """Fastest wall time of ``repeat`` calls of ``run`` (after one warm-up call) and the last result."""
    result = run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from mindspeed_llm.inference import InferenceEngine, SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.layers, args.hidden, args.vocab)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        ours = InferenceEngine.from_pretrained(tmp, dtype="float32", max_batch_size=max(args.batch_sizes))
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        generator = torch.Generator().manual_seed(1)
        for batch in args.batch_sizes:
            prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=generator)

            def run_hf():
                with torch.inference_mode():
                    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)
                return out[:, args.prompt_len:].tolist()

            def run_ours():
                return [o.token_ids for o in ours.generate(prompts.tolist(), params)]

            hf_times, our_times = [], []
            hf_tokens = our_tokens = None
            for _ in range(args.repeat):  # interleaved: a noisy neighbour slows both alike
                t, hf_tokens = best_of(run_hf, 1)
                hf_times.append(t)
                t, our_tokens = best_of(run_ours, 1)
                our_times.append(t)
            generated = batch * args.new_tokens
            row = {"batch": batch, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                   "hf_s": min(hf_times), "ours_s": min(our_times),
                   "hf_tok_s": generated / min(hf_times), "ours_tok_s": generated / min(our_times),
                   "same_tokens": hf_tokens == our_tokens}
            row["speedup"] = row["ours_tok_s"] / row["hf_tok_s"]
            rows.append(row)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32; prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, eos ignored; best of {args.repeat}")
    print(f"{'batch':>5} {'HF generate tok/s':>18} {'engine tok/s':>13} {'speedup':>8} {'same tokens':>12}")
    for row in rows:
        print(f"{row['batch']:>5} {row['hf_tok_s']:>18.0f} {row['ours_tok_s']:>13.0f} {row['speedup']:>7.2f}x "
              f"{str(row['same_tokens']):>12}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
