"""Memory of LoRA RL against full-parameter GRPO: the actor and its KL reference on one rank.

For each model shape, two fresh processes (one rank each, fp32, Adam) build what a GRPO run with a
KL penalty holds on an actor rank and run one update with the reference's log-probs:

- ``full``: the trainable actor (every weight, its fp32 gradient buffer, Adam's two moments) and a
  separate frozen reference actor (its weights);
- ``lora``: the actor with LoRA on every megatron linear (``actor.lora``: the frozen base, the
  factors, their gradients and moments); the reference is the same model with its adapters off.

Counted: parameter bytes (actor + reference), gradient-buffer bytes (the trained parameters' fp32
``main_grad``), optimizer-state bytes (Adam's tensors after the update), their sum, and the peak
resident set size of the process (``ru_maxrss``) minus its resident size after the imports (the
baseline, printed too; Linux). The numbers are docs/rl/lora.md's.

Usage::

    uv run --frozen python tools/bench/rl_lora.py                   # tiny and small shapes
    uv run --frozen python tools/bench/rl_lora.py --shapes small --r 16 --alpha 32 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

#: name -> (hidden, intermediate, layers, heads, vocab)
SHAPES = {"tiny": (128, 256, 2, 4, 512), "small": (768, 2048, 8, 12, 32000)}
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PAIRS = [([1, 5, 9, 14] * 8, [20, 21, 7] * 8), ([3, 4] * 16, [30, 31, 32, 33, 2] * 6)]


def write_model(shape: tuple[int, ...], path: Path) -> None:
    """A randomly initialised Llama of ``shape`` as a Hugging Face directory (with the tiny tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.testing.tiny_models import write_tiny_tokenizer

    hidden, inter, layers, heads, vocab = shape
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    write_tiny_tokenizer(path)


def _rss_mib() -> float:
    """The process's peak resident set size (Linux: ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    """The resident set size now (``VmRSS``): a forked child inherits its parent's peak, not its size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    out = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for state in torch_optimizer.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return out


def measure(rank: int, world_size: int, model: str, mode: str, r: int, alpha: float) -> dict[str, Any]:
    """One mode's bytes and peak RSS (run in a fresh single-rank process)."""
    import megatron.core  # noqa: F401  (the baseline includes the imports)

    from mindspeed_llm.engine import LoraSettings, unwrap
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.models.actor_lora import AdapterOffReference

    baseline = _current_rss_mib()
    lora = LoraSettings(r=r, alpha=alpha, target_modules=TARGETS) if mode == "lora" else None
    settings = ActorSettings.adamw(lr=1e-4, micro_batch_size=2, lora=lora)
    settings.loss_config = None
    actor = Actor(model, settings)
    reference = AdapterOffReference(actor) if lora else Actor(model, settings, trainable=False)
    width = max(len(resp) for _, resp in PAIRS)
    ref = torch.zeros(len(PAIRS), width)
    for i, row in enumerate(reference.compute_logprobs(PAIRS)):
        ref[i, : len(row)] = row
    actor.update(PAIRS, None, torch.tensor([1.0, -1.0]), ref)
    params = [p for c in actor.chunks for p in unwrap(c).parameters()]
    ref_params = [] if lora else [p for c in reference.chunks for p in unwrap(c).parameters()]
    trained = [p for p in params if p.requires_grad]
    out = {
        "mode": mode,
        "parameters": sum(p.numel() for p in params),
        "trained": sum(p.numel() for p in trained),
        "actor_param_bytes": _bytes(params),
        "reference_param_bytes": _bytes(ref_params),
        "grad_bytes": sum(p.numel() * 4 for p in trained),  # the fp32 main_grad buffer
        "optimizer_bytes": _bytes(_optimizer_tensors(actor.optimizer)),
        "baseline_rss_mib": baseline,
        "peak_rss_mib": _rss_mib(),
    }
    out["total_bytes"] = sum(
        out[k] for k in ("actor_param_bytes", "reference_param_bytes", "grad_bytes", "optimizer_bytes")
    )
    actor.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from mindspeed.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rl-lora-") as tmp:
        for name in args.shapes:
            path = Path(tmp) / name
            # In a child: this process stays small, so the measuring children (which keep their
            # parent's ru_maxrss across exec) start below their own peaks.
            writer = multiprocessing.get_context("spawn").Process(target=write_model, args=(SHAPES[name], path))
            writer.start()
            writer.join()
            if writer.exitcode != 0:
                raise SystemExit(f"writing the {name} model failed (exit {writer.exitcode})")
            for mode in ("full", "lora"):
                row = run_distributed(measure, 1, str(path), mode, args.r, args.alpha, timeout=900)[0]
                rows.append({"shape": name, **row})
    mib = 2**20
    print(
        "| model | mode | parameters | trained | actor + ref weights MiB | grads MiB | Adam MiB | total MiB | peak RSS - baseline MiB |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        weights = (row["actor_param_bytes"] + row["reference_param_bytes"]) / mib
        print(
            f"| {row['shape']} | {row['mode']} | {row['parameters']:,} | {row['trained']:,} | {weights:.1f} | "
            f"{row['grad_bytes'] / mib:.2f} | {row['optimizer_bytes'] / mib:.2f} | {row['total_bytes'] / mib:.1f} | "
            f"{row['peak_rss_mib'] - row['baseline_rss_mib']:.0f} (baseline {row['baseline_rss_mib']:.0f}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
