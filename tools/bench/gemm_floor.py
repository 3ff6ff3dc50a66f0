"""The matrix-multiply floor of ``tools/bench/pretrain.py``: how fast any trainer could be.

Both sides of the pretrain benchmark do the same matrix multiplies (the same Llama, tokens,
fp32): three GEMMs per linear layer and step (forward, input gradient, weight gradient) that
no implementation of the step can skip. This script times, in one process and alternating,
Hugging Face's ``LlamaForCausalLM`` forward + backward on one microbatch and those GEMMs alone
(the same shapes, plain ``torch`` calls), in CPU time of the process. ``HF / GEMMs`` is the
largest speed-up over Hugging Face's forward + backward that a step doing the same arithmetic
can reach, with every other operation (attention, norms, activations, loss, Python) free.
Usage::

    uv run --frozen python tools/bench/gemm_floor.py                 # tiny and small, 1 thread
    uv run --frozen python tools/bench/gemm_floor.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import torch
import torch.nn.functional as F
from pretrain import SIZES, hf_config  # the pretrain benchmark's shapes and its LlamaConfig

#: The padded vocabulary of the demo tokenizer (what ``pretrain.py`` trains).
VOCAB = 1792


def shape_config(size: str) -> object:
    """The ``LlamaConfig`` of ``pretrain.py --size size``."""
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.quickstart import TINY_CPU_RECIPE

    overrides = [f"{key}={value}" for key, value in SIZES[size].items()]
    config = load_pretrain_config(TINY_CPU_RECIPE, [*overrides, f"model.vocab_size={VOCAB}", "data.seq_length=128"])
    shape = hf_config(config)
    shape._attn_implementation = "sdpa"
    return shape


def linear_shapes(shape: object) -> list[tuple[int, int]]:
    """``(in, out)`` of every linear of the model (Hugging Face's unfused q/k/v and gate/up), LM head last."""
    h, f = shape.hidden_size, shape.intermediate_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return layer * shape.num_hidden_layers + [(h, shape.vocab_size)]


def measure(size: str, micro_batch: int, seq_length: int, repeats: int) -> dict[str, float]:
    """Median CPU seconds of Hugging Face's forward + backward and of its GEMMs alone."""
    from transformers import LlamaForCausalLM

    shape = shape_config(size)
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape)
    tokens = torch.randint(0, shape.vocab_size, (micro_batch, seq_length))
    rows = micro_batch * seq_length
    shapes = linear_shapes(shape)
    weights = [torch.randn(out, inp) for inp, out in shapes]
    inputs = {inp: torch.randn(rows, inp) for inp, _ in shapes}
    grads = {out: torch.randn(rows, out) for _, out in shapes}

    def hf_step() -> None:
        model(input_ids=tokens, labels=tokens, shift_labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)

    def gemms() -> None:
        for (inp, out), weight in zip(shapes, weights):
            F.linear(inputs[inp], weight)
            torch.mm(grads[out], weight)
            torch.mm(grads[out].t(), inputs[inp])

    variants: dict[str, Callable[[], None]] = {"hf": hf_step, "gemms": gemms}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Print, per size, the CPU time of HF's forward + backward, of its GEMMs, and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9, help="alternating repeats; the median counts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"batch {args.micro_batch} x {args.seq_length} tokens, fp32, {args.threads} thread(s), "
        f"median of {args.repeats}, CPU time",
        "",
        "| size | HF forward + backward ms | its GEMMs alone ms | GEMM share | bound: HF / GEMMs |",
        "|---|---|---|---|---|",
    ]
    for size in args.sizes:
        result = measure(size, args.micro_batch, args.seq_length, args.repeats)
        hf, gemm = result["hf"], result["gemms"]
        lines.append(f"| {size} | {hf * 1e3:.1f} | {gemm * 1e3:.1f} | {gemm / hf:.2f} | {hf / gemm:.2f} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child.main_with_load_record(main))
