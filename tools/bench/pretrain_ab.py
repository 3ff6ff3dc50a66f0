"""One step of ``mindspeed-llm pretrain`` against one of Hugging Face's, in ONE process, alternating.

``tools/bench/pretrain.py`` runs each side in a fresh process; on a shared machine their CPU
times move with the neighbours between processes. Here both sides live in one process, on one
torch thread, and their steps alternate (ours, HF, ours, HF, ...; who goes first rotates) on the
same batches, so the neighbours disturb both alike: the ratio of mean CPU seconds per step is
what to read.

- ours: :func:`mindspeed_llm.training.trainer.pretrain` with ``pretrain.py``'s recipe (the
  tiny_cpu recipe, ``--size``'s shape, level 2), whose training loop is replaced by this
  alternating loop (``Trainer._step`` under ``fast_path()``, exactly what the loop runs: data,
  zero grads, megatron's schedule, loss, DDP finalize, the distributed optimizer's step with its
  grad norm, clipping and copies, the scheduler);
- HF: ``LlamaForCausalLM`` (SDPA) from the initial weights our trainer exports, on the same
  samples (``shift_labels``), ``clip_grad_norm_``, fused AdamW with ``Trainer``'s parameter
  groups (no weight decay on norms and biases) and its ``cosine_with_min_lr`` schedule,
  ``zero_grad(set_to_none=True)``: what ``Trainer``'s step does, without its callbacks.

``--parts`` prints CPU ms per step of each part of both steps (data, zero grads, forward,
backward, DDP finalize, loss reduction, grad norm + clip, optimizer, scheduler), timed by
wrapping the functions that do them; ``--profile ours|hf|both`` adds ``torch.profiler`` tables
(CPU self time by op) of the timed steps; ``--cprofile DIR`` writes a CPU-time cProfile of each
side (``ab_ours.prof``, ``ab_hf.prof``; it inflates ours, which makes 3.6x HF's Python calls).
``--compile [MODE]`` runs ours with ``train.compile`` (compiled in the first warmup pair);
``--by-thread`` prints the CPU ms per step of every thread of the process (main, OpenMP workers,
gloo's), both sides. ``--workdir`` keeps the prepared data and initial weights for the next run. Usage::

    uv run --frozen python tools/bench/pretrain_ab.py --size tiny --rounds 20
    uv run --frozen python tools/bench/pretrain_ab.py --size small --rounds 6
    uv run --frozen python tools/bench/pretrain_ab.py --size tiny --rounds 12 --compile --parts --by-thread
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _child  # tools/bench/_child.py: the script's folder is on sys.path
import pretrain


def _hf_side(spec: dict[str, Any], config: Any) -> Any:
    """HF's model, optimizer and scheduler, and a step function over a step index."""
    import torch
    from transformers import LlamaForCausalLM, get_scheduler
    from transformers.trainer_pt_utils import get_parameter_names

    t, shape = config.train, pretrain.hf_config(config)
    shape._attn_implementation = "sdpa"
    model = LlamaForCausalLM.from_pretrained(spec["init_hf"], config=shape, dtype=torch.float32)
    model.train()
    # Trainer.create_optimizer's groups: weight decay on everything but biases and norm weights.
    decay = set(get_parameter_names(model, [torch.nn.LayerNorm, *_norm_types(model)], ["bias"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": t.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    params = [p for _, p in named]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, fused=True)
    scheduler = get_scheduler(
        "cosine_with_min_lr",
        optimizer,
        num_warmup_steps=t.lr_warmup_steps,
        num_training_steps=t.steps,
        scheduler_specific_kwargs={"min_lr": t.min_lr},
    )
    data = torch.load(Path(spec["workdir"]) / "samples.pt")
    labels = data["labels"].masked_fill(data["loss_mask"] == 0, -100)
    per_step = spec["micro_batch"] * spec["grad_accum"]

    def step(k: int, parts: Parts) -> float:
        total = 0.0
        for m in range(spec["grad_accum"]):
            with parts("data"):
                rows = slice(k * per_step + m * spec["micro_batch"], k * per_step + (m + 1) * spec["micro_batch"])
                items = int((labels[k * per_step : (k + 1) * per_step] != -100).sum())
                batch = {"input_ids": data["tokens"][rows], "labels": labels[rows], "shift_labels": labels[rows]}
            with parts("forward"):
                # Trainer's loss with accumulation: the step's token mean (sum over microbatches).
                loss = model(**batch).loss * int((labels[rows] != -100).sum()) / items
            with parts("backward"):
                loss.backward()
            total += float(loss.detach())
        with parts("grad norm + clip"):
            torch.nn.utils.clip_grad_norm_(params, t.clip_grad)
        with parts("optimizer"):
            optimizer.step()
        with parts("scheduler"):
            scheduler.step()
        with parts("zero grads"):
            optimizer.zero_grad(set_to_none=True)
        return total

    return step


class Parts:
    """CPU seconds per named part of a step (``--parts``): ``with parts("name"): ...`` and wrapped methods."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.totals, self.active = enabled, {}, False

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        if not (self.enabled and self.active):
            yield
            return
        start = time.process_time()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.process_time() - start

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time ``owner.attr`` (a function or bound method) as part ``name``."""
        if not self.enabled:
            return
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self(name):
                return inner(*args, **kwargs)

        setattr(owner, attr, timed)


def _wrap_ours(trainer: Any, parts: Parts) -> None:
    """Time the parts of ``Trainer._step``: data, zero grads, megatron's forward and backward steps,
    DDP finalize, the loss reduction, and the optimizer's grad norm, clip, AdamW and copies."""
    import megatron.core.optimizer.optimizer as megatron_optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.utils import get_model_config

    import mindspeed_llm.training.steps as steps

    parts.wrap(trainer.train_reader, "step", "data")
    parts.wrap(schedules, "forward_step", "forward")
    parts.wrap(schedules, "backward_step", "backward")
    config = get_model_config(trainer.chunks[0])
    parts.wrap(config, "finalize_model_grads_func", "DDP finalize")
    parts.wrap(steps, "reduce_metrics", "loss reduction")
    for chunk in trainer.chunks:
        parts.wrap(chunk, "zero_grad_buffer", "zero grads")
    parts.wrap(trainer.optimizer, "zero_grad", "zero grads")
    parts.wrap(trainer.optimizer, "get_grad_norm", "grad norm + clip")
    parts.wrap(megatron_optimizer, "clip_grad_by_total_norm_fp32", "grad norm + clip")
    parts.wrap(trainer.optimizer, "step_with_ready_grads", "optimizer")
    parts.wrap(trainer.optimizer, "prepare_grads", "optimizer")
    parts.wrap(trainer.scheduler, "step", "scheduler")


def _thread_cpu() -> dict[int, tuple[str, int]]:
    """CPU nanoseconds each thread of this process has run (``/proc/self/task/*/schedstat``), with its name."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            found[int(task.name)] = (name, int((task / "schedstat").read_text().split()[0]))
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile, or no schedstat (not Linux)
            continue
    return found


def _norm_types(model: Any) -> list[type]:
    return list({type(m) for name, m in model.named_modules() if "norm" in type(m).__name__.lower()})


def _alternate(trainer: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The replaced ``Trainer.train``: ``rounds`` x (our step, HF step) on the same samples."""
    import torch

    from mindspeed.megatron import fast_path

    config, state = trainer.config, trainer.state
    hf_step = _hf_side(spec, config)
    parts = {side: Parts(spec["parts"]) for side in ("ours", "hf")}
    _wrap_ours(trainer, parts["ours"])
    gbs, num_micro = config.global_batch_size(trainer.world), config.num_microbatches(trainer.world)
    steps = spec["steps"]
    sides = ("ours", "hf")
    times: dict[str, list[float]] = {side: [] for side in sides}
    walls: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {side: [] for side in sides}
    profiles = {side: cProfile.Profile(time.process_time) for side in sides} if spec["cprofile"] else {}
    torch_profs: dict[str, Any] = {}
    # --by-thread: CPU seconds of each thread (main, OpenMP workers, gloo's, ...) during each side's timed steps.
    by_thread: dict[str, dict[str, float]] = {side: {} for side in sides}
    if spec["profile"]:
        from torch.profiler import ProfilerActivity, profile

        # One profiler per side, started and stopped around that side's timed steps only.
        targets = sides if spec["profile"] == "both" else (spec["profile"],)
        torch_profs = {
            side: profile(activities=[ProfilerActivity.CPU], acc_events=True, record_shapes=spec["shapes"])
            for side in targets
        }

    def run(side: str, k: int, timed: bool) -> None:
        torch_prof = torch_profs.get(side) if timed else None
        profiled = torch_prof is not None
        if timed and side in profiles:
            profiles[side].enable()
        if profiled:
            torch_prof.start()
        parts[side].active = timed
        before = _thread_cpu() if timed and spec["by_thread"] else {}
        start, wall_start = time.process_time(), time.perf_counter()
        with fast_path():  # both sides outside the device redirect (the trainer's loop runs its steps so)
            if side == "ours":
                state.consumed_train_samples = k * gbs  # step k's batch: the samples of HF's step k
                loss = trainer._step(state, gbs, num_micro)["loss"]
            else:
                loss = hf_step(k, parts[side])
        elapsed, wall = time.process_time() - start, time.perf_counter() - wall_start
        for tid, (name, ns) in (_thread_cpu() if before else {}).items():
            key = "main" if tid == os.getpid() else f"{name} ({tid})"
            used = (ns - before.get(tid, (name, 0))[1]) / 1e9
            by_thread[side][key] = by_thread[side].get(key, 0.0) + used
        if profiled:
            torch_prof.stop()
        if timed and side in profiles:
            profiles[side].disable()
        if timed:
            times[side].append(elapsed)
            walls[side].append(wall)
        losses[side].append(loss)

    for r in range(spec["warmup"] + spec["rounds"]):
        k = r % steps
        for side in sides[r % 2 :] + sides[: r % 2]:  # rotate who goes first
            run(side, k, r >= spec["warmup"])
    for side, prof in profiles.items():
        prof.dump_stats(Path(spec["cprofile"]) / f"ab_{side}.prof")
    for side, torch_prof in torch_profs.items():
        table = torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=spec["rows"])
        sys.stdout.write(f"torch.profiler, {side}, {spec['rounds']} timed steps:\n{table}\n")
        if spec["shapes"]:
            table = torch_prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=spec["rows"], max_name_column_width=30
            )
            sys.stdout.write(f"by input shapes, {side}:\n{table}\n")
    parts_per_step = {side: {n: v / spec["rounds"] for n, v in p.totals.items()} for side, p in parts.items()}
    threads_per_step = {side: {n: v / spec["rounds"] for n, v in t.items() if v > 0} for side, t in by_thread.items()}
    return {
        "times": times,
        "walls": walls,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "parts": parts_per_step,
        "by_thread": threads_per_step,
    }


def _target(spec: dict[str, Any]) -> dict[str, Any]:
    extra = [f"train.compile={spec['compile']}"] if spec["compile"] else []
    config = pretrain.load_config(spec, spec["steps"], spec["level"], extra=extra)
    return _child.steps_in_trainer(config, lambda trainer: _alternate(trainer, spec), spec["threads"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(pretrain.SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=20, help="timed (ours, HF) pairs (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="distinct batches, step k of them in turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--level", type=int, default=2, help="our features.optimization_level (default 2)")
    parser.add_argument(
        "--profile", choices=("ours", "hf", "both"), default=None, help="torch.profiler table of one side or of both"
    )
    parser.add_argument("--shapes", action="store_true", help="with --profile: also the table by input shapes")
    parser.add_argument("--rows", type=int, default=30, help="rows of the --profile table")
    parser.add_argument("--cprofile", default=None, help="write ab_ours.prof / ab_hf.prof to this folder")
    parser.add_argument("--parts", action="store_true", help="CPU ms per part of a step, both sides")
    parser.add_argument("--workdir", default=None, help="reuse this folder's prepared data and weights")
    parser.add_argument(
        "--by-thread", action="store_true", help="CPU ms per step of each thread of the process, both sides"
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="true",
        default=None,
        help="ours with train.compile=MODE (true, default when given alone; max-autotune), compiled in the first warmup step",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pretrain-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps or pretrain.STEPS[args.size]
    spec = {
        "workdir": str(work),
        "size": args.size,
        "steps": steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "micro_batch": 8,
        "grad_accum": 1,
        "seq_length": 128,
        "threads": args.threads,
        "level": args.level,
        "profile": args.profile,
        "rows": args.rows,
        "cprofile": args.cprofile,
        "parts": args.parts,
        "shapes": args.shapes,
        "compile": args.compile,
        "by_thread": args.by_thread,
    }
    facts = work / f"facts_{args.size}.json"  # the prepared data and weights of a --workdir, reused
    if facts.is_file():
        spec.update(json.loads(facts.read_text()))
    else:
        found = pretrain.run_child("prepare", spec, work / "prepare.log")
        facts.write_text(json.dumps(found))
        spec.update(found)
    if not spec.get("init_hf"):
        raise SystemExit(f"the initial weights were not exported (see {work / 'prepare.log'})")
    from mindspeed.launch import launch

    load = [os.getloadavg()[0]]
    out = launch(_target, (spec,), nproc_per_node=1)
    load.append(os.getloadavg()[0])
    ours, hf = (statistics.mean(out["times"][s]) for s in ("ours", "hf"))
    each = {s: ", ".join(f"{t:.3f}" for t in out["times"][s]) for s in ("ours", "hf")}
    sys.stdout.write(
        f"size {args.size}, {args.threads} thread(s), {args.rounds} timed rounds: mean CPU s per step ours "
        f"{ours:.4f}, HF {hf:.4f}; HF / ours {hf / ours:.3f} (median {statistics.median(out['times']['hf']) / statistics.median(out['times']['ours']):.3f}); "
        f"first losses ours {out['losses']['ours'][0]:.6f} HF {out['losses']['hf'][0]:.6f}; load "
        f"{load[0]:.1f}-{load[1]:.1f}\nmean wall s per step ours {statistics.mean(out['walls']['ours']):.4f}, "
        f"HF {statistics.mean(out['walls']['hf']):.4f}; HF / ours {statistics.mean(out['walls']['hf']) / statistics.mean(out['walls']['ours']):.3f}"
        f"\nours each: {each['ours']}\nHF each: {each['hf']}\n"
    )
    if args.parts:
        names = list(dict.fromkeys([*out["parts"]["ours"], *out["parts"]["hf"]]))
        sys.stdout.write("| part | ours ms | HF ms |\n| --- | --- | --- |\n")
        for name in names:
            cells = [f"{out['parts'][s][name] * 1e3:.1f}" if name in out["parts"][s] else "-" for s in ("ours", "hf")]
            sys.stdout.write(f"| {name} | {cells[0]} | {cells[1]} |\n")
        sys.stdout.write(f"| whole step | {ours * 1e3:.1f} | {hf * 1e3:.1f} |\n")
    if args.by_thread:
        sys.stdout.write("| thread | ours ms | HF ms |\n| --- | --- | --- |\n")
        names = list(dict.fromkeys([*out["by_thread"]["ours"], *out["by_thread"]["hf"]]))
        for name in names:
            cells = [f"{out['by_thread'][s].get(name, 0.0) * 1e3:.1f}" for s in ("ours", "hf")]
            sys.stdout.write(f"| {name} | {cells[0]} | {cells[1]} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
