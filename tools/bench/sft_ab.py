"""One LoRA step of ``mindspeed-llm sft`` against one of ``peft`` + transformers, in ONE process, alternating.

``tools/bench/sft.py`` runs each side in a fresh process; on a shared machine their CPU times
move with the neighbours between processes. Here both sides live in one process, on one torch
thread, and their steps alternate (ours, HF, ours, HF, ...) on the same batches, so the
neighbours disturb both alike: the ratio of mean CPU seconds per step (over the same steps: HF's
padding differs from step to step) is what to read.

- ours: :func:`mindspeed_llm.training.trainer.pretrain` with ``stage=sft`` and LoRA (the
  settings of ``sft.py``), whose training loop is replaced by this alternating loop
  (``Trainer._step`` under ``fast_path()``, exactly what the loop runs);
- HF: ``LlamaForCausalLM`` (SDPA) + ``peft`` LoRA from the same directory, each microbatch of
  our step padded to its longest sample (``sft.py``'s padding collator), loss summed over the
  step's label tokens (``num_items_in_batch``, as ``Trainer`` does), ``clip_grad_norm_`` and
  fused AdamW (what ``Trainer`` picks), ``zero_grad(set_to_none=True)``.

``--profile ours|hf`` adds a ``torch.profiler`` table (CPU self time by op) of that side's timed
steps; ``--cprofile DIR`` writes a cProfile of each side. Usage::

    uv run --frozen python tools/bench/sft_ab.py --size small --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import sft


def _hf_side(spec: dict[str, Any]) -> Any:
    """The peft model, its optimizer and scheduler, and a step function over microbatch lists."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, get_scheduler

    t = spec["train"]
    model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=spec["r"],
            lora_alpha=spec["alpha"],
            lora_dropout=spec["dropout"],
            target_modules=sft.HF_TARGETS,
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=t["lr"], betas=(t["adam_beta1"], t["adam_beta2"]), eps=t["adam_eps"], weight_decay=0.0, fused=True
    )
    scheduler = get_scheduler(
        "cosine_with_min_lr",
        optimizer,
        num_warmup_steps=t["lr_warmup_steps"],
        num_training_steps=10**6,
        scheduler_specific_kwargs={"min_lr": t["min_lr"]},
    )

    def step(microbatches: list[list[tuple[Any, Any]]]) -> float:
        batches = [sft.pad_samples(mb) for mb in microbatches]
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for batch in batches:
            loss = model(**batch, num_items_in_batch=torch.tensor(items)).loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, t["clip_grad"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step


def _before_forward(self: Any, input_: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``LoraLinear.forward`` before issue 18 item 2: ``F.dropout``, B's GEMM, then scale and add."""
    import torch.nn.functional as F

    from mindspeed_llm.training.lora import LoraLinear

    output, bias = super(LoraLinear, self).forward(input_, *args, **kwargs)
    x = input_
    if self.training and self.lora_dropout_p:
        if self.lora_row or self.sequence_parallel:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                x = F.dropout(x, self.lora_dropout_p, training=True)
        else:
            x = F.dropout(x, self.lora_dropout_p, training=True)
    dropout_p, self.lora_dropout_p = self.lora_dropout_p, 0.0  # lora_partial without its own dropout
    try:
        partial = self.lora_partial(x)
    finally:
        self.lora_dropout_p = dropout_p
    delta = F.linear(partial, self.lora_B["default"].weight) * self.lora_scaling
    return output + delta.to(output.dtype), bias


@contextlib.contextmanager
def _lora_before() -> Any:
    """Our LoRA layers as they were before issue 18 item 2, for the ``--before`` side."""
    from mindspeed_llm.training.lora import LoraLinear

    current = LoraLinear.forward
    LoraLinear.forward = _before_forward
    try:
        yield
    finally:
        LoraLinear.forward = current


def _alternate(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The replaced ``Trainer.train``: ``rounds`` x (our step, HF step) on the same microbatches."""
    import torch

    from mindspeed.megatron import fast_path

    microbatches = torch.load(Path(spec["workdir"]) / "microbatches.pt")
    accum, steps = spec["grad_accum"], spec["steps"]
    hf_step = _hf_side(spec)
    config, state = trainer.config, trainer.state
    gbs, num_micro = config.global_batch_size(trainer.world), config.num_microbatches(trainer.world)
    sides = ("ours", "before", "hf") if spec["before"] else ("ours", "hf")
    times: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {side: [] for side in sides}
    profiles = {side: cProfile.Profile(time.process_time) for side in times} if spec["cprofile"] else {}
    torch_prof = None
    if spec["profile"]:
        from torch.profiler import ProfilerActivity, profile

        torch_prof = profile(activities=[ProfilerActivity.CPU], acc_events=True)

    def run(side: str, k: int, timed: bool) -> None:
        if timed and side in profiles:
            profiles[side].enable()
        if timed and torch_prof is not None and side == spec["profile"]:
            torch_prof.start()
        start = time.process_time()
        # Both sides outside the device redirect (the trainer's loop runs its steps so).
        with fast_path(), _lora_before() if side == "before" else contextlib.nullcontext():
            if side != "hf":
                state.consumed_train_samples = k * gbs  # step k's batches: the same samples as HF's step k
                loss = trainer._step(state, gbs, num_micro)["loss"]
            else:
                loss = hf_step(microbatches[k * accum : (k + 1) * accum])
        elapsed = time.process_time() - start
        if timed and torch_prof is not None and side == spec["profile"]:
            torch_prof.stop()
        if timed and side in profiles:
            profiles[side].disable()
        if timed:
            times[side].append(elapsed)
        losses[side].append(loss)

    for r in range(spec["warmup"] + spec["rounds"]):
        k = r % steps
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:  # rotate who goes first
            run(side, k, r >= spec["warmup"])
    for side, prof in profiles.items():
        prof.dump_stats(Path(spec["cprofile"]) / f"ab_{side}.prof")
    if torch_prof is not None:
        table = torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=spec["rows"])
        sys.stdout.write(f"torch.profiler, {spec['profile']}, {spec['rounds']} timed steps:\n{table}\n")
    return {"times": times, "losses": losses}


def _target(spec: dict[str, Any]) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config

    config = load_pretrain_config(None, sft.recipe_overrides(spec))
    return _child.steps_in_trainer(config, lambda trainer: _alternate(trainer, spec), spec["threads"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(sft.SIZES), default="small")
    parser.add_argument(
        "--rounds", type=int, default=8, help="timed (ours, HF) pairs, step k of 8 in turn (default 8: every step once)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first (default 2)")
    parser.add_argument(
        "--before",
        action="store_true",
        help="a third side: our step with the LoRA layer as it was before issue 18 item 2 (F.dropout, "
        "separate scaling and add)",
    )
    parser.add_argument(
        "--profile", choices=("ours", "before", "hf"), default=None, help="torch.profiler table of one side"
    )
    parser.add_argument("--rows", type=int, default=30, help="rows of the --profile table")
    parser.add_argument("--cprofile", default=None, help="write ab_ours.prof / ab_hf.prof to this folder")
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-sft-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = 8
    spec = {
        "workdir": str(work),
        "size": args.size,
        "steps": steps,
        "micro_batch": 2,
        "grad_accum": 2,
        "seq_length": 256,
        "threads": 1,
        "seed": 1234,
        "r": 8,
        "alpha": 16.0,
        "dropout": args.dropout,
        "train": {
            "lr": 2e-3,
            "min_lr": 2e-4,
            "lr_warmup_steps": 2,
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_eps": 1e-8,
            "clip_grad": 1.0,
        },
        "rounds": args.rounds,
        "warmup": args.warmup,
        "profile": args.profile,
        "before": args.before,
        "rows": args.rows,
        "cprofile": args.cprofile,
    }
    facts = sft.prepare(spec)
    spec.update(model_dir=facts["model_dir"], prefix=facts["prefix"])
    from mindspeed.launch import launch

    load = [os.getloadavg()[0]]
    out = launch(_target, (spec,), nproc_per_node=1)
    load.append(os.getloadavg()[0])
    ours, hf = (statistics.mean(out["times"][s]) for s in ("ours", "hf"))
    if args.before:
        before = statistics.mean(out["times"]["before"])
        sys.stdout.write(
            f"before: mean CPU s per step {before:.3f}, HF / before {hf / before:.3f}, before / ours "
            f"{before / ours:.3f} (each: {', '.join(f'{t:.2f}' for t in out['times']['before'])}); first loss "
            f"{out['losses']['before'][0]:.5f}\n"
        )
    sys.stdout.write(
        f"size {args.size}, {args.rounds} timed rounds: mean CPU s per step ours {ours:.3f}, HF+peft (padding) "
        f"{hf:.3f}; HF / ours {hf / ours:.3f} (ours each: {', '.join(f'{t:.2f}' for t in out['times']['ours'])}; HF each: "
        f"{', '.join(f'{t:.2f}' for t in out['times']['hf'])}); first losses ours {out['losses']['ours'][0]:.5f} "
        f"HF {out['losses']['hf'][0]:.5f}; load {load[0]:.1f}-{load[1]:.1f}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
