"""Benchmark ``mindspeed-llm sft`` (LoRA, QLoRA) against ``peft`` + Hugging Face ``Trainer``.

Both sides fine-tune the same Llama (a random-weight Hugging Face directory built here, with
the demo tokenizer) on the same token sequences, in the same order and grouping, with the same
LoRA rank, alpha, dropout and targets (every linear of every layer), micro batch, gradient
accumulation, AdamW settings, learning-rate schedule (linear warmup, cosine to ``min_lr``),
gradient clipping and fp32, on the CPU with the same number of threads:

- ours: :func:`mindspeed_llm.training.trainer.pretrain` with ``stage=sft`` on one rank (what
  ``mindspeed-llm sft`` runs with one process), ``checkpoint.load_hf`` = the directory,
  ``lora.target_modules`` = the four megatron linears (fused qkv and gate/up: MindSpeed-LLM's
  layout), once with ``lora.qlora=true`` (NF4 base); the shipped Alpaca demo data tokenized by
  ``preprocess-data --pack`` (rows of ``--seq-length`` tokens); a microbatch is the samples of
  ``--micro-batch`` rows packed into one sequence (no attention across samples), padded at
  its end to ``micro batch x seq length`` tokens (the recipe default);
- Hugging Face: ``LlamaForCausalLM`` (SDPA) from the same directory, ``peft.get_peft_model``
  with ``LoraConfig(target_modules=[q,k,v,o,gate,up,down]_proj)``, ``Trainer`` fed one item per
  microbatch holding exactly the samples of our microbatch (read back from the indexed datasets
  with our ``DocumentDataset`` in our order: same ``input_ids``, labels -100 on prompts), once
  with a padding collator (each microbatch padded to its longest sample, the usual setup) and
  once with ``DataCollatorWithFlattening`` (padding-free: one row, positions restart, SDPA with a
  block-diagonal mask over the row). QLoRA needs bitsandbytes, which is not installed (and has no CPU 4-bit
  path): that row reads n/a.

Tokens/s counts non-padding tokens only (the same on every side: the samples' tokens), over the
timed steps (after ``--warmup``); what each side actually computes, padding included, is in
the table. Time is the loop period (start of a step to the start of the next: data, forward,
backward, optimizer, everything). Every run is a fresh process, so its peak RSS (``VmHWM``) is
its own; the runs alternate, ``--repeats`` times; a run's rate is its median step's, a variant's
its best run's (neighbours on a busy machine only ever slow a run down). The first-step losses
must agree (B = 0, so both are the base model's loss on the same tokens); later ones differ a
little (the LoRA A factors start from different random draws, and ours shares one A across
q/k/v and gate/up). The load average is recorded around and inside every run: a row that saw
a busy machine (``--max-load``, default cores + 1) is marked noisy, and ``--table FILE`` (the
tables for the docs) refuses to write them from a busy run. Usage::

    uv run --frozen python tools/bench/sft.py                 # tiny: 4 layers, hidden 256
    uv run --frozen python tools/bench/sft.py --size small    # 8 layers, hidden 768
    uv run --frozen python tools/bench/sft.py --quick         # a smoke run (< 1 min)

Generation tokens/s against ``model.generate`` is ``tools/bench/generate.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from _child import MB, LoadRecord, memory_status

#: Model shapes of ``--size`` (the vocabulary is 2048 for all: the demo tokenizer's 1746 fit).
SIZES = {
    "tiny": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "small": {
        "num_hidden_layers": 8,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
}
STEPS = {"tiny": 20, "small": 8}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUR_TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
DEMO_ALPACA = Path(__file__).resolve().parents[2] / "packages/llm/src/mindspeed_llm/assets/demo_alpaca.jsonl"
HF_PAD, HF_FLAT = "HF Trainer + peft LoRA, padding collator", "HF Trainer + peft LoRA, flattened (no padding)"


# ----------------------------------------------------------------------------- preparation


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model directory, tokenize the demo data, and write the microbatches both sides train on.

    Returns:
        Facts for the table: tokens per step, padding of each side, parameter counts.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mindspeed_llm.data.preprocess import PreprocessConfig, preprocess_data
    from mindspeed_llm.tokenizer import load_tokenizer
    from mindspeed_llm.training.finetune_data import INSTRUCTION_KEYS, DocumentDataset, _segments

    work, model_dir = Path(spec["workdir"]), Path(spec["workdir"]) / f"model_{spec['size']}"
    config = LlamaConfig(
        vocab_size=2048,
        max_position_embeddings=max(spec["seq_length"], 256),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
        **SIZES[spec["size"]],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    load_tokenizer("demo").save_pretrained(model_dir)
    prefix = str(work / f"alpaca_{spec['seq_length']}")
    preprocess_data(
        PreprocessConfig(
            input=str(DEMO_ALPACA),
            tokenizer_name_or_path=str(model_dir),
            handler_name="AlpacaStyleInstructionHandler",
            output_prefix=prefix,
            seq_length=spec["seq_length"],
            pack=True,
        )
    )
    # The trainer's sample order (train split = everything, seeded shuffle, endless epochs) and
    # its microbatches: the samples of micro_batch rows (PackedMicrobatchReader with one rank).
    rows = DocumentDataset([prefix], INSTRUCTION_KEYS, "100,0,0", 0, spec["seed"], shuffle=True)
    mbs, accum, seq = spec["micro_batch"], spec["grad_accum"], spec["seq_length"]
    microbatches = []
    for m in range(spec["steps"] * accum):
        samples = [seg for i in range(m * mbs, (m + 1) * mbs) for seg in _segments(rows[i])]
        microbatches.append(
            [(torch.from_numpy(ids[:seq].copy()), torch.from_numpy(labels[:seq].copy())) for ids, labels in samples]
        )
    torch.save(microbatches, work / "microbatches.pt")
    lengths = [[len(ids) for ids, _ in mb] for mb in microbatches]
    steps = [lengths[s * accum : (s + 1) * accum] for s in range(spec["steps"])]
    return {
        "model_dir": str(model_dir),
        "prefix": prefix,
        "rows": len(rows),
        "step_tokens": [sum(map(sum, step)) for step in steps],
        "trained_tokens": [
            sum(int((labels[1:] != -100).sum()) for mb in microbatches[s * accum : (s + 1) * accum] for _, labels in mb)
            for s in range(spec["steps"])
        ],
        "samples_per_step": statistics.mean(sum(map(len, step)) for step in steps),
        "ours_computed": mbs * seq * accum,  # every microbatch padded to micro_batch x seq_length
        "hf_pad_computed": statistics.mean(sum(len(mb) * max(mb) for mb in step) for step in steps),
        "base_parameters": sum(p.numel() for p in model.parameters()),
    }


# ----------------------------------------------------------------------------- children


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class StepClock:
    """Start times (wall, CPU) of every step, and a CPU-time cProfile of the timed steps when asked."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.starts, self.profile = spec, {}, None

    def step_started(self, step: int) -> None:
        """Call at the start of every step (1-based)."""
        if step in self.starts:
            return
        self.starts[step] = _now()
        path, first = self.spec.get("profile"), self.spec["warmup"] + 1
        if path and step == first:
            import cProfile

            self.profile = cProfile.Profile(time.process_time)
            self.profile.enable()
        elif path and step == self.spec["steps"] and self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(path)

    def periods(self) -> dict[str, Any]:
        """Timed steps and their wall and CPU periods (start of step ``s`` to start of ``s + 1``)."""
        timed = [s for s in sorted(self.starts) if s > self.spec["warmup"] and s + 1 in self.starts]
        return {
            "timed_steps": timed,
            "periods": [self.starts[s + 1][0] - self.starts[s][0] for s in timed],
            "cpu_periods": [self.starts[s + 1][1] - self.starts[s][1] for s in timed],
        }


def pad_samples(samples: list[tuple[Any, Any]]) -> dict[str, Any]:
    """HF's padded batch of ``(ids, labels)`` samples: right-padded ids, -100 labels and a 0 mask past each sample."""
    import torch

    longest = max(len(ids) for ids, _ in samples)
    out = {
        "input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
    }
    for row, (ids, labels) in enumerate(samples):
        out["input_ids"][row, : len(ids)], out["labels"][row, : len(ids)] = ids, labels
        out["attention_mask"][row, : len(ids)] = 1
    return out


def recipe_overrides(spec: dict[str, Any]) -> list[str]:
    """The ``key=value`` overrides of our SFT side's recipe (also :mod:`sft_ab`'s): the same model, data and LoRA."""
    t = spec["train"]
    return [
        "stage=sft",
        f"checkpoint.load_hf={spec['model_dir']}",
        f"data.prefixes=[{spec['prefix']}]",
        "data.split=100,0,0",
        f"data.seq_length={spec['seq_length']}",
        f"train.steps={spec['steps']}",
        f"train.micro_batch_size={spec['micro_batch']}",
        f"train.global_batch_size={spec['micro_batch'] * spec['grad_accum']}",
        f"train.seed={spec['seed']}",
        *[f"train.{k}={v}" for k, v in t.items()],
        f"lora.target_modules={OUR_TARGETS}",
        f"lora.r={spec['r']}",
        f"lora.alpha={spec['alpha']}",
        f"lora.dropout={spec['dropout']}",
        f"lora.qlora={str(spec.get('qlora', False)).lower()}",
        "eval.interval=null",
        "eval.at_end=false",
        "checkpoint.save=null",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        "logging.dir=null",
    ]


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """One ``sft`` run of our trainer (LoRA, or QLoRA with ``spec["qlora"]``)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import megatron.core.models.gpt  # noqa: F401  (imported before the baseline RSS, like transformers there)
    import megatron.core.optimizer  # noqa: F401

    import mindspeed_llm.training.trainer_load as trainer_module  # where the trainer calls apply_lora
    from mindspeed.launch import launch
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.qlora import quantized_bytes
    from mindspeed_llm.training.trainer import TrainerHooks, pretrain

    base, load = memory_status(), os.getloadavg()[0]
    clock, facts = StepClock(spec), {}

    def counting(apply: Any) -> Any:
        # The trainer calls apply_lora / apply_qlora on each bare chunk: the wrapper sees it.
        def counted(model: Any, settings: Any) -> list[str]:
            adapted = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in settings.target_modules]
            facts["adapted_weight_numel"] = sum(m.weight.numel() for m in adapted)
            names = apply(model, settings)
            facts["nf4_bytes"] = quantized_bytes(model)
            facts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            return names

        return counted

    def stamp(step: int, losses: torch.Tensor) -> torch.Tensor:
        clock.step_started(step)
        return losses

    trainer_module.apply_lora = counting(trainer_module.apply_lora)
    trainer_module.apply_qlora = counting(trainer_module.apply_qlora)
    config = load_pretrain_config(None, [*recipe_overrides(spec), f"logging.interval={spec['steps']}"])
    result = launch(pretrain, (config, TrainerHooks(loss_transform=stamp)), nproc_per_node=1)
    records = [r for r in result.records if r["kind"] == "train"]
    return {
        **clock.periods(),
        "losses": [r["loss"] for r in records],
        "step_tokens": [r["step_tokens"] for r in records],
        "trained_tokens": [r["tokens"] for r in records],
        "threads": torch.get_num_threads(),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **facts,
        **memory_status(),
    }


def child_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of ``peft`` LoRA under Hugging Face ``Trainer`` on the prepared microbatches."""
    import torch

    torch.set_num_threads(spec["threads"])
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorWithFlattening, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    base, load = memory_status(), os.getloadavg()[0]
    work = Path(spec["workdir"])
    microbatches = torch.load(work / "microbatches.pt")
    flatten = DataCollatorWithFlattening(return_tensors="pt")

    def collate(items: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        (samples,) = items  # one item = one of our microbatches
        if spec["collator"] == "flat":
            return flatten([{"input_ids": ids, "labels": labels} for ids, labels in samples])
        return pad_samples(samples)

    class Microbatches(torch.utils.data.IterableDataset):
        # In order (Trainer shuffles map-style datasets): the order our trainer reads them in.
        def __iter__(self) -> Any:
            yield from microbatches

    clock, losses = StepClock(spec), []

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_started(state.global_step + 1)

    class LossTrainer(Trainer):
        # A microbatch's returned loss is its share of the step's token mean: their sum per step.
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            if len(losses) <= self.state.global_step:
                losses.append(0.0)
            losses[self.state.global_step] += float(loss)
            return loss

    t = spec["train"]
    model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=spec["r"],
            lora_alpha=spec["alpha"],
            lora_dropout=spec["dropout"],
            target_modules=HF_TARGETS,
            task_type="CAUSAL_LM",
        ),
    )
    args = TrainingArguments(
        output_dir=str(work / "hf_out"),
        max_steps=spec["steps"],
        per_device_train_batch_size=1,
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=t["lr"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": t["min_lr"]},
        warmup_steps=t["lr_warmup_steps"],
        weight_decay=t["weight_decay"],
        adam_beta1=t["adam_beta1"],
        adam_beta2=t["adam_beta2"],
        adam_epsilon=t["adam_eps"],
        max_grad_norm=t["clip_grad"],
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=spec["seed"],
        remove_unused_columns=False,
        label_names=["labels"],
    )
    trainer = LossTrainer(
        model=model, args=args, train_dataset=Microbatches(), data_collator=collate, callbacks=[Timer()]
    )
    trainer.train()
    return {
        **clock.periods(),
        "losses": losses,
        "threads": torch.get_num_threads(),
        "trainable": model.get_nb_trainable_parameters()[0],
        "optim": getattr(args.optim, "value", str(args.optim)),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


CHILDREN = {"ours": child_ours, "hf": child_hf}


# ----------------------------------------------------------------------------- driver


def run_child(kind: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run ``kind`` in a fresh interpreter (its output in ``log``) and return its result."""
    return _child.run_child(__file__, kind, spec, log, None)


def summarize(runs: list[dict[str, Any]], facts: dict[str, Any], reference: list[float]) -> dict[str, Any]:
    """One variant over its repeats: tokens/s (non-padding tokens) of a run is the median over its
    timed steps, of the variant the best run's (a busy machine only ever slows a run down)."""

    def rate(run: dict[str, Any], key: str) -> float:
        return statistics.median(facts["step_tokens"][s - 1] / p for s, p in zip(run["timed_steps"], run[key]))

    losses = runs[0]["losses"]
    return {
        "tokens_per_s": max(rate(r, "periods") for r in runs),
        "cpu_tokens_per_s": max(rate(r, "cpu_periods") for r in runs),
        "step_s": statistics.median(statistics.median(r["periods"]) for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "import_rss_mb": statistics.median(r["import_rss_mb"] for r in runs),
        "end_rss_mb": statistics.median(r["rss_mb"] for r in runs),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "first_loss_diff": abs(losses[0] - reference[0]),
        "trainable": runs[0]["trainable"],
        "nf4_bytes": runs[0].get("nf4_bytes"),
        "adapted_weight_numel": runs[0].get("adapted_weight_numel"),
        "load": _child.load_range(runs),
        "runs_tokens_per_s": [round(rate(r, "periods")) for r in runs],
        "threads": sorted({r["threads"] for r in runs}),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny: 4 layers, hidden 256, ffn 688; small: 8 layers, hidden 768, ffn 2048",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per run (default: {', '.join(f'{k} {v}' for k, v in STEPS.items())})",
    )
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (default 2)")
    parser.add_argument("--micro-batch", type=int, default=2, help="packed rows per microbatch (default 2)")
    parser.add_argument("--grad-accum", type=int, default=2, help="microbatches per step (default 2)")
    parser.add_argument("--seq-length", type=int, default=256, help="tokens per packed row (default 256)")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (default 0.05)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating (default 3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (and OMP_NUM_THREADS) of every run (default 1: on a busy machine a "
        "second OpenMP thread mostly spins waiting for the first)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write a CPU-time cProfile of the timed steps of each variant's first run to the workdir",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 5 steps, 1 repeat, ours LoRA and HF (padding) only"
    )
    parser.add_argument("--workdir", default=None, help="model, data and logs (default: a temporary directory)")
    _child.add_record_args(parser)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = STEPS[args.size]
    if args.quick:
        args.steps, args.repeats, args.warmup = 5, 1, 1
    for name in ("steps", "micro_batch", "grad_accum", "seq_length", "repeats", "threads", "r"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.warmup < 0 or args.steps < args.warmup + 3:
        parser.error(
            f"--steps={args.steps} leaves fewer than 2 timed steps after --warmup={args.warmup}; "
            f"use at least {max(args.warmup, 0) + 3} steps and a non-negative warmup"
        )
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout={args.dropout} must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table (or, with ``--child``, one side of it)."""
    args = parse_args(argv)
    if args.child:
        return _child.child_main(CHILDREN, args.child, args.child_spec)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sft-"))
    work.mkdir(parents=True, exist_ok=True)
    train = {
        "lr": 2e-3,
        "min_lr": 2e-4,
        "lr_warmup_steps": min(5, args.steps // 4),
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "clip_grad": 1.0,
    }
    spec = {
        "workdir": str(work),
        "size": args.size,
        "steps": args.steps,
        "warmup": args.warmup,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "seq_length": args.seq_length,
        "threads": args.threads,
        "seed": 1234,
        "r": args.r,
        "alpha": args.alpha,
        "dropout": args.dropout,
        "train": train,
    }
    started, load = time.perf_counter(), LoadRecord(args.max_load)
    facts = prepare(spec)
    spec.update(model_dir=facts["model_dir"], prefix=facts["prefix"])
    variants = {"ours LoRA (mindspeed-llm sft)": {"kind": "ours", "qlora": False}}
    if not args.quick:
        variants["ours QLoRA (NF4 base)"] = {"kind": "ours", "qlora": True}
    variants[HF_PAD] = {"kind": "hf", "collator": "pad"}
    if not args.quick:
        variants[HF_FLAT] = {"kind": "hf", "collator": "flat"}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for number, (name, variant) in enumerate(variants.items()):
            child = {**spec, **variant}
            if args.profile and repeat == 0:
                child["profile"] = str(work / f"profile_{number}_{variant['kind']}.prof")
            runs[name].append(run_child(variant["kind"], child, work / f"run_{repeat}_{number}.log"))
    for name, variant_runs in runs.items():  # both sides must have trained on the prepared tokens
        ours = [r for r in variant_runs if "step_tokens" in r]
        if any(
            r["step_tokens"] != facts["step_tokens"] or r["trained_tokens"] != facts["trained_tokens"] for r in ours
        ):
            raise SystemExit(f"{name} trained on other tokens than the Hugging Face runs were given; see {work}")
    results = {
        name: {**summarize(r, facts, runs[HF_PAD][0]["losses"]), "noisy": load.noisy(r)} for name, r in runs.items()
    }
    noisy = any(r["noisy"] for r in results.values())
    steps_tokens = statistics.mean(facts["step_tokens"])
    # QLoRA's first loss is over the NF4-rounded base: only the full-precision bases must agree.
    first = max(r["first_loss_diff"] / r["first_loss"] for name, r in results.items() if "QLoRA" not in name)
    header = (
        f"size {args.size} ({facts['base_parameters'] / 1e6:.1f} M parameters, vocabulary 2048), fp32, LoRA r "
        f"{args.r} alpha {args.alpha:g} dropout {args.dropout:g} on every linear; demo Alpaca data packed in rows of "
        f"{args.seq_length} ({facts['rows']} rows); {args.steps} steps ({args.warmup} untimed) of {args.micro_batch} "
        f"rows x {args.grad_accum} microbatches = {facts['samples_per_step']:.1f} samples, {steps_tokens:.0f} "
        f"non-padding tokens per step; torch threads {args.threads} on "
        f"{os.cpu_count()} cores; best of {args.repeats} run(s) of the median step; HF optimizer "
        f"{runs[HF_PAD][0]['optim']}; torch "
        f"{version('torch')}, transformers {version('transformers')}, peft {version('peft')}; first-step losses "
        f"agree to {first:.1e} (relative); {load.header(noisy)}; {time.perf_counter() - started:.0f} s; "
        f"workdir {work}"
    )
    table = report(results, facts, header)
    sys.stdout.write(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"header": header, "facts": facts, "results": results, "runs": runs}, indent=2)
        )
    return load.write_table(args.table, table, noisy)


def report(results: dict[str, dict[str, Any]], facts: dict[str, Any], header: str) -> str:
    """Two side-by-side tables (speed; memory and checks), ratios against the padding-collator HF run
    in wall time and in CPU time; a row measured on a busy machine is marked noisy."""
    hf, flat, lines = results[HF_PAD], results.get(HF_FLAT), []
    write = lines.append
    computed = {HF_PAD: facts["hf_pad_computed"], HF_FLAT: statistics.mean(facts["step_tokens"])}

    def ratios(r: dict[str, Any], key: str) -> str:
        return " | ".join(format(r[key] / ref[key], ".2f") if ref else "-" for ref in (hf, flat))

    write(
        header + "\n\n| run | tokens/s | / HF pad | / HF flat | tokens/s of CPU time | / HF pad | / HF flat "
        "| step s | load | tokens/s of each run |\n" + "|---" * 10 + "|\n"
    )
    for name, r in results.items():
        write(
            f"| {name}{' (noisy)' if r['noisy'] else ''} | {r['tokens_per_s']:,.0f} | {ratios(r, 'tokens_per_s')} "
            f"| {r['cpu_tokens_per_s']:,.0f} "
            f"| {ratios(r, 'cpu_tokens_per_s')} | {r['step_s']:.3f} | {r['load'][0]:.1f}-{r['load'][1]:.1f} "
            f"| {', '.join(f'{v:,}' for v in r['runs_tokens_per_s'])} |\n"
        )
    reason = "bitsandbytes not installed / no CPU 4-bit" if find_spec("bitsandbytes") is None else "no CPU 4-bit"
    write(f"| HF Trainer + peft QLoRA | n/a ({reason}) |" + " |" * 8 + "\n")
    write(
        "\n| run | peak RSS MB | / HF pad | RSS after imports MB | peak - imports MB | RSS at end MB | trainable parameters "
        "| frozen base of the adapted linears | tokens computed per step | loss step 1 | final loss |\n"
        + "|---" * 11
        + "|\n"
    )
    numel = next(r["adapted_weight_numel"] for r in results.values() if r["adapted_weight_numel"])
    for name, r in results.items():
        base = (
            f"{r['nf4_bytes'] / MB:.2f} MB NF4 = {r['nf4_bytes'] / (numel * 4):.3f} of fp32, "
            f"{r['nf4_bytes'] / (numel * 2):.3f} of bf16"
            if r["nf4_bytes"]
            else f"{numel * 4 / MB:.2f} MB fp32"
        )
        write(
            f"| {name} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / hf['peak_rss_mb']:.2f} | {r['import_rss_mb']:.0f} "
            f"| {r['peak_rss_mb'] - r['import_rss_mb']:.0f} | {r['end_rss_mb']:.0f} | {r['trainable']:,} | {base} "
            f"| {computed.get(name, facts['ours_computed']):.0f} | {r['first_loss']:.4f} | {r['final_loss']:.4f} |\n"
        )
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
