"""Benchmark lm-eval with ``--model mindspeed`` against lm-eval's own ``--model hf`` on the same work.

Both run lm-eval's ``simple_evaluate`` on the three shipped ``mindspeed_*`` tasks over the shipped
demo data (MMLU 5-shot: 24 questions, 96 log-likelihood requests; GSM8K 0-shot: 10 greedy
generations; perplexity: 4 documents, rolling log-likelihood), with the same ``max_length``,
``batch_size`` and generation budget, fp32, on the CPU. The model is a Hugging Face directory
(``--load-dir``) or, by default, a random-weight Llama built here with the demo tokenizer (4 layers,
hidden 256). Each backend is timed over its whole ``simple_evaluate`` (model load, task load,
requests, metrics); the runs alternate ``--repeat`` times and the best is kept. Wall time and CPU
time (user + system of this process) are reported, and the script checks that both backends gave
the same answers (log-likelihoods within 1e-5, the same generated strings).

Usage::

    uv run --frozen python tools/bench/lm_eval_harness.py
    uv run --frozen python tools/bench/lm_eval_harness.py --load-dir runs/quickstart/hf --repeat 3 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

TASKS = ["mindspeed_mmlu", "mindspeed_gsm8k", "mindspeed_ppl"]


def build_model(path: Path, layers: int, hidden: int) -> None:
    """A random-weight Llama sized to the demo tokenizer, saved with it as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from mindspeed_llm.tokenizer import demo_tokenizer_path

    tok = AutoTokenizer.from_pretrained(str(demo_tokenizer_path()), local_files_only=True)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(str(path))


def run_backend(model: str, load_dir: str, args: argparse.Namespace) -> tuple[float, float, dict]:
    """Wall seconds, CPU seconds and lm-eval's output of one ``simple_evaluate``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from mindspeed_llm.evaluation.harness.run import HARNESS_TASKS_DIR

    model_args = {"pretrained": load_dir, "max_length": args.max_length, "batch_size": args.batch_size}
    model_args |= {"dtype": "float32"} | ({"device": "cpu"} if model == "hf" else {})
    wall, cpu = time.perf_counter(), time.process_time()
    output = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(HARNESS_TASKS_DIR), include_defaults=False),
        log_samples=True,
        gen_kwargs={"max_gen_toks": args.max_gen_toks},
    )
    return time.perf_counter() - wall, time.process_time() - cpu, output


def same_answers(a: dict, b: dict) -> bool:
    """Every request's answer equal: floats within 1e-5 (relative or absolute), everything else exactly."""

    def flat(value):
        return [x for item in value for x in flat(item)] if isinstance(value, (list, tuple)) else [value]

    for task in TASKS:
        for sa, sb in zip(*(sorted(o["samples"][task], key=lambda s: s["doc_id"]) for o in (a, b))):
            for x, y in zip(flat(sa["resps"]), flat(sb["resps"]), strict=True):
                if isinstance(y, float) and abs(x - y) > 1e-5 * max(1.0, abs(y)):
                    return False
                if not isinstance(y, float) and x != y:
                    return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-dir", help="Hugging Face model directory (default: a random Llama built here)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both backends)")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()

    import torch

    from mindspeed_llm.evaluation.harness.model import register_harness_model

    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    os.environ.setdefault("TQDM_DISABLE", "1")
    register_harness_model()
    with tempfile.TemporaryDirectory() as tmp:
        load_dir = args.load_dir
        if load_dir is None:
            load_dir = str(Path(tmp) / "model")
            build_model(Path(load_dir), args.layers, args.hidden)
        best: dict[str, tuple[float, float]] = {}
        outputs: dict[str, dict] = {}
        for _ in range(args.repeat):
            for model in ("mindspeed", "hf"):
                wall, cpu, outputs[model] = run_backend(model, load_dir, args)
                if model not in best or wall < best[model][0]:
                    best[model] = (wall, cpu)
    same = same_answers(outputs["mindspeed"], outputs["hf"])
    rows = []
    for model in ("mindspeed", "hf"):
        metrics = {
            t: {k: v for k, v in r.items() if "stderr" not in k and k != "alias"}
            for t, r in outputs[model]["results"].items()
        }
        rows.append(
            {"model": model, "wall_s": round(best[model][0], 2), "cpu_s": round(best[model][1], 2), "results": metrics}
        )
        print(f"{model:10s} wall {best[model][0]:7.2f} s   cpu {best[model][1]:7.2f} s   {json.dumps(metrics)}")
    print(f"same answers request by request: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows, "same": same}, indent=2) + "\n")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
