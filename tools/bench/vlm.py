"""Benchmark ``mindspeed-mm train`` (full and LoRA) against Hugging Face ``Trainer`` (+ ``peft``) on a Qwen2.5-VL.

Both sides fine-tune the same Qwen2.5-VL (random weights, built here in code: a window-attention
ViT, the 2x2 merger and a Qwen2 language model, about 25 M parameters with ``--size small``,
the byte tokenizer of the tiny models) on the same image-question samples (images of varied
sizes and, with ``--data mixed``, text-only samples, so samples differ in length), in the same order and grouping, with the same AdamW
settings, learning-rate schedule, clipping and fp32, on the CPU with the same threads:

- ours: :func:`mindspeed_mm.trainer.loop.train` on one rank (what ``mindspeed-mm train``
  runs with one process; in fp32 that is the model without FSDP2, which one rank does not
  need), the core's attention registered in transformers
  (``mindspeed``; the vision tower's windows in one varlen call, its patch embedding as a
  matmul: :func:`mindspeed_mm.models.loading.load_model`), each microbatch's samples packed
  into one row without padding;
- Hugging Face: ``Qwen2_5_VLForConditionalGeneration`` (SDPA) under ``Trainer``, fed one item
  per microbatch holding exactly the samples of ours, encoded by our encoder (same ``input_ids``,
  labels, ``mm_token_type_ids``, pixels and grids), padded to the microbatch's longest sample by
  the collator (LLaMA-Factory's setup); LoRA through ``peft.get_peft_model`` with our targets'
  regular expression (the language model's linears).

Tokens/s counts non-padding tokens only (the samples' tokens, the same on both sides) over the
timed steps (after ``--warmup``, which also covers our trainer's one-time encoding: the data set
holds exactly the warmup steps' samples, so later steps revisit them); time is the loop period
(start of a step to the start of the next), reported as wall time and CPU time. Every run is a
fresh process: its peak RSS (``VmHWM``) is its own; the runs alternate, ``--repeats`` times, and
a side's rate is its best run's median step. The table gives each variant's load average (the
lowest at a run's start to the highest at a run's end): on a shared host wall times mean little
without it. Usage::

    uv run --frozen python tools/bench/vlm.py                 # small: ~25 M parameters
    uv run --frozen python tools/bench/vlm.py --quick         # a smoke run
    uv run --frozen python tools/bench/vlm.py --flops         # FLOPs per step of each side, no timing
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
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
from _child import memory_status
from sft import StepClock

#: Language-model and vision-tower shapes of ``--size``.
SIZES = {
    "tiny": (
        {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        {"depth": 2, "hidden_size": 64, "intermediate_size": 176, "num_heads": 2},
    ),
    "small": (
        {
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        {"depth": 4, "hidden_size": 256, "intermediate_size": 704, "num_heads": 4},
    ),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 40)}
ANSWERS = [
    "It is {c}.",
    "The picture is mostly {c}, with a little noise on top of it.",
    "{c}",
    "Looking closely at every part of the image, I would say that the dominant colour is {c}.",
]


# ----------------------------------------------------------------------------- preparation


def write_model(directory: Path, size: str) -> int:
    """A Qwen2.5-VL of ``size`` with the tiny models' byte tokenizer; returns its parameter count."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mindspeed_mm.models.qwen2_5_vl import CHAT_TEMPLATE, SPECIAL_TOKENS
    from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer

    text, vision = SIZES[size]
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]  # sums to head_dim / 2, as Qwen2.5-VL's
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            **text,
        },
        vision_config={
            "out_hidden_size": text["hidden_size"],
            "window_size": 112,
            "fullatt_block_indexes": [vision["depth"] - 1],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
            **vision,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=448 * 448).save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


#: ``--data``: (smallest and largest image side in pixels, every how many samples one is text-only; 0: none).
DATA = {"narrow": (56, 224, 0), "mixed": (28, 448, 4)}


def write_data(directory: Path, num_samples: int, seed: int, kind: str) -> Path:
    """``data.jsonl`` of colour questions on noisy images (sides drawn from ``DATA[kind]``), answers of varied lengths.

    ``narrow``: every sample has an image of 56..224 pixels a side (4..64 image tokens);
    ``mixed``: 28..448 pixels (1..256 image tokens) and every 4th sample text-only, as in
    instruction-tuning mixes.
    """
    import numpy as np
    from PIL import Image

    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    smallest, largest, text_only = DATA[kind]
    lines = []
    for i in range(num_samples):
        name = list(COLOURS)[i % len(COLOURS)]
        answer = ANSWERS[int(rng.integers(len(ANSWERS)))].format(c=name)
        if text_only and i % text_only == text_only - 1:
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": f"Which colour comes after {name}?"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
            continue
        height, width = (int(x) for x in rng.choice(range(smallest, largest + 1, 28), size=2))
        pixels = np.clip(np.array(COLOURS[name]) + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(directory / "images" / f"{i:04d}.png")
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>What colour is this picture?"},
                    {"role": "assistant", "content": answer},
                ],
                "images": [f"images/{i:04d}.png"],
            }
        )
    target = directory / "data.jsonl"
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Model, data, and the microbatches of every step in our trainer's order (what the HF side is fed)."""
    import torch

    from mindspeed_mm.data.encode import IGNORE_INDEX, encode_sample
    from mindspeed_mm.data.mllm import read_mllm_files
    from mindspeed_mm.data.order import SampleOrder
    from mindspeed_mm.models import family_of, load_processing

    work = Path(spec["workdir"])
    model_dir = work / f"model_{spec['size']}"
    parameters = write_model(model_dir, spec["size"])
    per_step = spec["micro_batch"] * spec["grad_accum"]
    data = write_data(work / "data", per_step * spec["warmup"], spec["seed"], spec["data_kind"])
    family = family_of(model_dir)
    tokenizer, processor = load_processing(model_dir, spec["min_pixels"], spec["max_pixels"])
    encoded = [encode_sample(s, tokenizer, processor, family, spec["cutoff_len"]) for s in read_mllm_files([str(data)])]
    order = SampleOrder(len(encoded), spec["micro_batch"], spec["grad_accum"], 1, spec["seed"], True)
    microbatches = [
        [
            {
                "input_ids": encoded[i].input_ids,
                "labels": encoded[i].labels,
                "mm_token_type_ids": encoded[i].mm_token_type_ids,
                **encoded[i].vision,
            }
            for i in order.indices(step, 0, j)
        ]
        for step in range(1, spec["steps"] + 1)
        for j in range(spec["grad_accum"])
    ]
    torch.save(microbatches, work / "microbatches.pt")
    steps = [microbatches[s * spec["grad_accum"] : (s + 1) * spec["grad_accum"]] for s in range(spec["steps"])]
    lengths = [[[int(x["input_ids"].numel()) for x in mb] for mb in step] for step in steps]
    return {
        "model_dir": str(model_dir),
        "data": str(data),
        "parameters": parameters,
        "samples": len(encoded),
        "step_tokens": [sum(map(sum, step)) for step in lengths],
        "label_tokens": [sum(int((x["labels"] != IGNORE_INDEX).sum()) for mb in step for x in mb) for step in steps],
        "hf_computed": statistics.mean(sum(len(mb) * max(mb) for mb in step) for step in lengths),
        "sample_tokens": [
            min(min(min(mb) for mb in step) for step in lengths),
            max(max(max(mb) for mb in step) for step in lengths),
        ],
    }


# ----------------------------------------------------------------------------- children


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """One ``mindspeed-mm train`` run (one rank)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers  # noqa: F401  (imported before the baseline RSS, as on the HF side)

    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer import loop, vlm_task

    base, load = memory_status(), os.getloadavg()[0]
    clock = StepClock(spec)
    microbatches = vlm_task.VLMTask.microbatches

    def stamped(self: Any, step: int, rank: int) -> Any:
        clock.step_started(step)
        return microbatches(self, step, rank)

    vlm_task.VLMTask.microbatches = stamped
    facts: dict[str, int] = {}
    build_optimizer = loop.build_optimizer

    def counted(train_config: Any, model: Any) -> Any:
        facts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return build_optimizer(train_config, model)

    loop.build_optimizer = counted
    t = spec["train"]
    overrides = [
        f"model.path={spec['model_dir']}",
        f"data.files=[{spec['data']}]",
        f"train.steps={spec['steps']}",
        f"train.micro_batch_size={spec['micro_batch']}",
        f"train.gradient_accumulation_steps={spec['grad_accum']}",
        f"train.seed={spec['seed']}",
        "train.precision=fp32",
        "train.lr_decay_style=cosine",
        *[f"train.{k}={v}" for k, v in t.items()],
        f"data.image_min_pixels={spec['min_pixels']}",
        f"data.image_max_pixels={spec['max_pixels']}",
        f"data.cutoff_len={spec['cutoff_len']}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        f"logging.interval={spec['steps']}",
    ]
    if spec["lora"]:
        overrides += [
            f"lora.target_modules=[{','.join(TARGETS)}]",
            f"lora.r={spec['r']}",
            f"lora.alpha={spec['alpha']}",
        ]
    result = launch(loop.train, (load_mm_config(None, overrides),))
    return {
        **clock.periods(),
        "losses": [r["loss"] for r in result.records],
        "tokens": [r["tokens"] for r in result.records],
        "threads": torch.get_num_threads(),
        "trainable": facts["trainable"],
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def _pad(samples: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """The padding collator: rows right-padded to the longest sample, vision inputs concatenated."""
    import torch

    longest = max(int(s["input_ids"].numel()) for s in samples)
    out = {
        "input_ids": torch.full((len(samples), longest), pad_id, dtype=torch.long),
        "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(len(samples), longest, dtype=torch.long),
    }
    for row, s in enumerate(samples):
        n = int(s["input_ids"].numel())
        out["input_ids"][row, :n], out["labels"][row, :n] = s["input_ids"], s["labels"]
        out["mm_token_type_ids"][row, :n], out["attention_mask"][row, :n] = s["mm_token_type_ids"], 1
    for key in ("pixel_values", "image_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            out[key] = torch.cat(parts)
    return out


def child_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """One Hugging Face ``Trainer`` run (``peft`` LoRA with ``spec["lora"]``) on the prepared microbatches."""
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import Qwen2_5_VLForConditionalGeneration, Trainer, TrainerCallback, TrainingArguments

    base, load = memory_status(), os.getloadavg()[0]
    work = Path(spec["workdir"])
    microbatches = torch.load(work / "microbatches.pt", weights_only=False)

    class Microbatches(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:  # in order: Trainer would shuffle a map-style data set
            yield from microbatches

    clock, losses = StepClock(spec), []

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_started(state.global_step + 1)

    class LossTrainer(Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)  # already divided by the accumulation steps
            if len(losses) <= self.state.global_step:
                losses.append(0.0)
            losses[self.state.global_step] += float(loss)
            return loss

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        from mindspeed_mm.config import MMLoraConfig as OurLora
        from mindspeed_mm.models import family_of
        from mindspeed_mm.models.lora import target_regex

        regex = target_regex(OurLora(target_modules=TARGETS), family_of(spec["model_dir"]))
        model = get_peft_model(
            model, LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=regex)
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pad_id = model.config.text_config.pad_token_id
    t = spec["train"]
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
        max_grad_norm=t["clip_grad"],
        optim="adamw_torch",
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
        # accelerate would otherwise cut every tensor of an iterable data set's batch to the batch's
        # rows (the 4 rows of input_ids would leave 4 rows of pixel patches)
        accelerator_config={"dispatch_batches": False},
    )
    trainer = LossTrainer(
        model=model,
        args=args,
        train_dataset=Microbatches(),
        data_collator=lambda items: _pad(items[0], pad_id),
        callbacks=[Timer()],
    )
    trainer.train()
    return {
        **clock.periods(),
        "losses": losses,
        "threads": torch.get_num_threads(),
        "trainable": trainable,
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def count_flops(spec: dict[str, Any], lora: bool) -> tuple[float, float]:
    """Matmul and attention FLOPs per step (forward + backward, ``torch.utils.flop_counter``) of (ours, HF).

    Over the first ``--warmup`` steps' microbatches: ours as our trainer computes its loss
    (packed, logits where predicted), HF's model on the padded microbatches. Their ratio is what
    the speed ratio would be at equal efficiency per FLOP.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config

    def ours_rank(config: Any) -> float:
        from mindspeed_mm.trainer.vlm_task import VLMTask

        task, total = VLMTask(config, 1), 0.0
        for step in range(1, spec["warmup"] + 1):
            micro = task.microbatches(step, 0)
            totals = task.counts(micro)
            with FlopCounterMode(display=False) as counter:
                for batch in micro:
                    task.loss(batch, totals)[0].backward()
            total += counter.get_total_flops()
        return total / spec["warmup"]

    overrides = [
        f"model.path={spec['model_dir']}",
        f"data.files=[{spec['data']}]",
        f"train.steps={spec['steps']}",
        f"train.micro_batch_size={spec['micro_batch']}",
        f"train.gradient_accumulation_steps={spec['grad_accum']}",
        f"train.seed={spec['seed']}",
        "train.precision=fp32",
        f"data.image_min_pixels={spec['min_pixels']}",
        f"data.image_max_pixels={spec['max_pixels']}",
        f"data.cutoff_len={spec['cutoff_len']}",
    ]
    if lora:
        overrides += [
            f"lora.target_modules=[{','.join(TARGETS)}]",
            f"lora.r={spec['r']}",
            f"lora.alpha={spec['alpha']}",
        ]
    ours = launch(ours_rank, (load_mm_config(None, overrides),))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    pad_id = model.config.text_config.pad_token_id
    if lora:
        from peft import LoraConfig, get_peft_model

        from mindspeed_mm.config import MMLoraConfig as OurLora
        from mindspeed_mm.models import family_of
        from mindspeed_mm.models.lora import target_regex

        regex = target_regex(OurLora(target_modules=TARGETS), family_of(spec["model_dir"]))
        model = get_peft_model(
            model, LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=regex)
        )
    microbatches = torch.load(Path(spec["workdir"]) / "microbatches.pt", weights_only=False)
    with FlopCounterMode(display=False) as counter:
        for microbatch in microbatches[: spec["warmup"] * spec["grad_accum"]]:
            model(**_pad(microbatch, pad_id)).loss.backward()
    return float(ours), counter.get_total_flops() / spec["warmup"]


CHILDREN = {"ours": child_ours, "hf": child_hf}


# ----------------------------------------------------------------------------- driver


def summarize(runs: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """One variant over its repeats: a run's rate is its median timed step's, the variant's its best run's."""

    def rate(run: dict[str, Any], key: str) -> float:
        return statistics.median(facts["step_tokens"][s - 1] / p for s, p in zip(run["timed_steps"], run[key]))

    return {
        "tokens_per_s": max(rate(r, "periods") for r in runs),
        "cpu_tokens_per_s": max(rate(r, "cpu_periods") for r in runs),
        "step_s": statistics.median(statistics.median(r["periods"]) for r in runs),
        "cpu_step_s": statistics.median(statistics.median(r["cpu_periods"]) for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "import_rss_mb": statistics.median(r["import_rss_mb"] for r in runs),
        "losses": runs[0]["losses"],
        "trainable": runs[0]["trainable"],
        "load": _child.load_range(runs),
        "runs_tokens_per_s": [round(rate(r, "periods")) for r in runs],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="small: ~25 M parameters; tiny: ~1 M")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed first steps; the data set holds exactly their samples (default 4)",
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per microbatch (default 4)")
    parser.add_argument("--grad-accum", type=int, default=2, help="microbatches per step (default 2)")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (default 1)")
    parser.add_argument(
        "--data",
        choices=sorted(DATA),
        default="mixed",
        help="mixed: images of 28..448 pixels a side and every 4th sample text-only (default); "
        "narrow: every sample an image of 56..224 pixels",
    )
    parser.add_argument("--variants", default="full,lora", help="full, lora or both (default full,lora)")
    parser.add_argument(
        "--flops",
        action="store_true",
        help="only count each side's FLOPs per step (torch.utils.flop_counter; no timed runs, load-independent)",
    )
    parser.add_argument("--profile", action="store_true", help="write a CPU-time cProfile of each variant's first run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny, 5 steps (2 untimed), 1 repeat")
    parser.add_argument("--workdir", default=None, help="model, data and logs (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    _child.add_record_args(parser)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.warmup, args.repeats = "tiny", 5, 2, 1
    for name in ("steps", "warmup", "micro_batch", "grad_accum", "repeats", "threads", "r"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.steps < args.warmup + 3:
        parser.error(f"--steps={args.steps} leaves fewer than 2 timed steps after --warmup={args.warmup}")
    if not set(args.variants.split(",")) <= {"full", "lora"}:
        parser.error(f"--variants={args.variants!r}: use full, lora or full,lora")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table (or, with ``--child``, one side of it)."""
    args = parse_args(argv)
    if args.child:
        return _child.child_main(CHILDREN, args.child, args.child_spec)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-vlm-"))
    work.mkdir(parents=True, exist_ok=True)
    train = {"lr": 1e-4, "min_lr": 1e-5, "lr_warmup_steps": 2, "weight_decay": 0.0, "clip_grad": 1.0}
    spec = {
        "workdir": str(work),
        "size": args.size,
        "steps": args.steps,
        "warmup": args.warmup,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "threads": args.threads,
        "seed": 1234,
        "r": args.r,
        "alpha": args.alpha,
        "train": train,
        "min_pixels": 28 * 28,
        "max_pixels": 448 * 448,
        "data_kind": args.data,
        "cutoff_len": 2048,
    }
    started, load = time.perf_counter(), _child.LoadRecord(args.max_load)
    facts = prepare(spec)
    spec.update(model_dir=facts["model_dir"], data=facts["data"])
    if args.flops:
        for kind in args.variants.split(","):
            ours, hf = count_flops(spec, kind == "lora")
            sys.stdout.write(
                f"{args.data} data, {kind}: GFLOP per step (forward + backward, first {args.warmup} steps) "
                f"ours {ours / 1e9:.1f}, HF {hf / 1e9:.1f}: HF / ours {hf / ours:.3f}\n"
            )
        return 0
    variants = {}
    for kind in args.variants.split(","):
        lora = kind == "lora"
        variants[f"ours {kind} (mindspeed-mm train)"] = {"kind": "ours", "lora": lora}
        variants[f"HF Trainer {kind}{' (peft)' if lora else ''}, padding collator"] = {"kind": "hf", "lora": lora}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for number, (name, variant) in enumerate(variants.items()):
            child = {**spec, **variant}
            if args.profile and repeat == 0:
                child["profile"] = str(work / f"profile_{number}_{variant['kind']}.prof")
            log = work / f"run_{repeat}_{number}.log"
            runs[name].append(_child.run_child(__file__, variant["kind"], child, log))
            # each run's result as it comes: a bench cut short on a loaded host still has its runs
            log.with_suffix(".result.json").write_text(json.dumps({"name": name, **runs[name][-1]}))
    for name, variant_runs in runs.items():  # ours must have trained on the tokens HF was given
        if any("tokens" in r and r["tokens"] != facts["step_tokens"] for r in variant_runs):
            raise SystemExit(f"{name} trained on other tokens than the Hugging Face runs were given; see {work}")
    results = {name: {**summarize(r, facts), "noisy": load.noisy(r)} for name, r in runs.items()}
    noisy = any(r["noisy"] for r in results.values())
    header = (
        f"Qwen2.5-VL {args.size} ({facts['parameters'] / 1e6:.1f} M parameters), {args.data} data, fp32, "
        f"{args.steps} steps "
        f"({args.warmup} untimed) of {args.micro_batch} samples x {args.grad_accum} microbatches, "
        f"{statistics.mean(facts['step_tokens']):.0f} non-padding tokens per step (samples of "
        f"{facts['sample_tokens'][0]}-{facts['sample_tokens'][1]} tokens; HF computes "
        f"{facts['hf_computed']:.0f} with padding); LoRA r {args.r} alpha {args.alpha:g} on the language model's "
        f"linears; torch threads {args.threads} on {os.cpu_count()} cores; best of {args.repeats} run(s) of the "
        f"median step; torch {version('torch')}, transformers {version('transformers')}, peft {version('peft')}; "
        f"{load.header(noisy)}; {time.perf_counter() - started:.0f} s; workdir {work}"
    )
    table = report(results, header)
    sys.stdout.write(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"header": header, "facts": facts, "results": results, "runs": runs}, indent=2)
        )
    return load.write_table(args.table, table, noisy)


def report(results: dict[str, dict[str, Any]], header: str) -> str:
    """The table: each of ours next to the HF run of the same kind, with ratios (wall and CPU time);
    a row measured on a busy machine is marked noisy."""
    lines: list[str] = []
    write = lines.append
    write(
        header + "\n\n| run | tokens/s | x HF | tokens/s of CPU time | x HF | step s (CPU s) | peak RSS MB | x HF "
        "| peak - imports MB | trainable | loss step 1 | last loss | tokens/s of each run | load average |\n"
        + "|---" * 14
        + "|\n"
    )
    names = list(results)
    for i, name in enumerate(names):
        r = results[name]
        hf = results[names[i + 1]] if i % 2 == 0 else r
        write(
            f"| {_child.mark(name, r['noisy'])} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / hf['tokens_per_s']:.2f} "
            f"| {r['cpu_tokens_per_s']:,.0f} | {r['cpu_tokens_per_s'] / hf['cpu_tokens_per_s']:.2f} "
            f"| {r['step_s']:.2f} ({r['cpu_step_s']:.2f}) | {r['peak_rss_mb']:.0f} "
            f"| {r['peak_rss_mb'] / hf['peak_rss_mb']:.2f} | {r['peak_rss_mb'] - r['import_rss_mb']:.0f} "
            f"| {r['trainable'] or '-'} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} "
            f"| {', '.join(f'{v:,}' for v in r['runs_tokens_per_s'])} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |\n"
        )
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
