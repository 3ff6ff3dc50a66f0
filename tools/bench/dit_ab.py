"""In one process, alternating: the diffusers loop's microbatch and step against ``DiTTask``'s, eager and compiled.

``tools/bench/dit.py`` runs each side in its own process, so a busy machine moves one side's time
and not the other's; here every variant runs in the same process, one after the other, round
after round, on the same weights and batches (the bench's ``prepare``), and the time is CPU time
(``time.process_time``, one thread), robust to other processes on the host. Variants:

- ``diffusers``: the bench's diffusers loop (its scheduler, ``get_sigmas``, loss, ``clip_grad_norm_``,
  ``torch.optim.AdamW``) on our microbatches;
- ``eager`` / ``compiled``: :class:`~mindspeed_mm.trainer.dit_task.DiTTask` (``train.compile`` false / true) and
  the trainer's step (:func:`mindspeed_mm.trainer.loop._train_step`, the stop agreement and the metrics write).

``--what micro`` times one microbatch's forward + backward (ours also reads and draws the step's
microbatches), ``--what step`` a whole optimizer step (its microbatches, clip, optimizer). Each variant has
its own model and optimizer (a step trains it). Per variant it also prints the garbage collector's time and
the kernel (system) time and minor page faults of its rounds: the process is shared, so one variant's
allocations move the others' page faults (see docs/mm/dit-parallelism.md). Run it with
``OMP_NUM_THREADS=1 MKL_NUM_THREADS=1``, as the bench's children. Usage::

    uv run --frozen python tools/bench/dit_ab.py --what micro --rounds 12
    uv run --frozen python tools/bench/dit_ab.py --what step --rounds 8 --profile /tmp/ab
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dit


def _spec(work: Path, threads: int) -> dict[str, Any]:
    return {
        "workdir": str(work),
        "steps": 8,
        "warmup": 3,
        "micro_batch": 2,
        "grad_accum": 2,
        "threads": threads,
        "seed": 1234,
        "shape": [16, 5, 16, 16],
        "long_shape": [16, 3, 16, 16],
        "text_len": dit.LONG_TEXT_LEN,
        "train": {"lr": 1e-4, "weight_decay": 0.0, "clip_grad": 1.0, "lr_warmup_steps": 0},
        "diffusion": {"shift": 3.0, "timestep_sampling": "logit_normal", "text_dropout": 0.0},
    }


def _diffusers(spec: dict[str, Any]) -> dict[str, Callable[[int], Any]]:
    """The bench's diffusers loop, cut into a microbatch and a step."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    steps = torch.load(Path(spec["workdir"]) / "microbatches.pt", weights_only=False)
    t, d = spec["train"], spec["diffusion"]
    model = WanTransformer3DModel.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)
    model.train()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=d["shift"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t["lr"], betas=(0.9, 0.999), weight_decay=t["weight_decay"], eps=1e-8)

    def get_sigmas(timesteps: torch.Tensor, n_dim: int) -> torch.Tensor:
        sigmas = scheduler.sigmas.to(dtype=torch.float32)
        indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def micro(batch: dict[str, Any], count: int) -> float:
        latents, noise, text = batch["latents"], batch["noise"], batch["text"]
        timesteps = scheduler.timesteps[batch["indices"]]
        sigmas = get_sigmas(timesteps, latents.ndim)
        noisy = (1.0 - sigmas) * latents + sigmas * noise
        pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=text, return_dict=False)[0]
        target = noise - latents
        loss = torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
        (loss / count).backward()
        return float(loss.detach()) / count

    def run_micro(number: int) -> Any:
        micro(steps[number % len(steps)][0], 1)
        model.zero_grad(set_to_none=True)

    def run_step(number: int) -> Any:
        mbs = steps[(number - 1) % len(steps)]
        total = sum(micro(b, len(mbs)) for b in mbs)
        norm = torch.nn.utils.clip_grad_norm_(params, t["clip_grad"])
        optimizer.step()
        optimizer.zero_grad()
        return total, float(norm)

    return {"micro": run_micro, "step": run_step}


def _ours(spec: dict[str, Any], compile_mode: str) -> dict[str, Callable[[int], Any]]:
    """``DiTTask`` and the trainer's step, as ``mindspeed-mm train`` runs them on one rank."""
    from mindspeed.checkpointing import Preemption
    from mindspeed.device import get_accelerator
    from mindspeed.metrics.log import MetricsLog
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer import loop
    from mindspeed_mm.trainer.optim import build_optimizer
    from mindspeed_mm.trainer.task import TASKS

    config = load_mm_config(None, dit._overrides({**spec, "compile": compile_mode}, spec["cache"]))
    task = TASKS.get("dit")(config, 1)
    optimizer = build_optimizer(config.train, task.model)
    trainable = [p for p in task.model.parameters() if p.requires_grad]
    metrics = MetricsLog(None, 0, enabled=True)
    preemption = Preemption(config.train.exit_duration_mins, config.checkpoint.save)
    steps = config.train.steps

    def run_micro(number: int) -> Any:
        batch = task.microbatches(number % steps + 1, 0)[0]
        totals = task.counts([batch])
        loss, _ = task.loss(batch, totals)
        loss.backward()
        task.model.zero_grad(set_to_none=True)

    def run_step(number: int) -> Any:
        preemption.agree(device=get_accelerator().device())
        record = loop._train_step(config, (number - 1) % steps + 1, 0, task, optimizer, trainable)
        metrics.write(record)
        return record["loss"], record["grad_norm"]

    return {"micro": run_micro, "step": run_step}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=["micro", "step"], default="step")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds of every variant (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3; the compile)")
    parser.add_argument("--variants", default="diffusers,eager,compiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="write a cProfile of each variant's timed rounds here")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warmup rounds")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="dit-ab-"))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))
    spec = _spec(work, args.threads)
    spec.update(dit.prepare(spec))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    names = args.variants.split(",")
    variants = {}
    for name in names:
        variants[name] = (
            _diffusers(spec) if name == "diffusers" else _ours(spec, "true" if name == "compiled" else "false")
        )
    times: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[Any]] = {name: [] for name in names}
    profiles = {name: cProfile.Profile(time.process_time) for name in names}
    load = [os.getloadavg()[0]]
    collected = {"s": 0.0, "n": 0, "start": 0.0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collected["start"] = time.process_time()
        else:
            collected["s"] += time.process_time() - collected["start"]
            collected["n"] += 1 if info["generation"] == 2 else 0

    gc.callbacks.append(on_gc)
    gc_s: dict[str, float] = {name: 0.0 for name in names}
    gc_full: dict[str, int] = {name: 0 for name in names}
    system: dict[str, float] = {name: 0.0 for name in names}
    faults: dict[str, int] = {name: 0 for name in names}
    for r in range(args.warmup + args.rounds):
        if r == args.warmup:
            print(f"gc: {len(gc.get_objects())} tracked objects after the warmup")
            if args.gc_freeze:
                gc.freeze()
        for name in names:
            before = dict(collected)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            run = variants[name][args.what]
            timed = r >= args.warmup
            if timed and args.profile:
                profiles[name].enable()
            start = time.process_time()
            out = run(r + 1)
            elapsed = time.process_time() - start
            if timed and args.profile:
                profiles[name].disable()
            if timed:
                times[name].append(elapsed)
                gc_s[name] += collected["s"] - before["s"]
                gc_full[name] += collected["n"] - before["n"]
                after = resource.getrusage(resource.RUSAGE_SELF)
                system[name] += after.ru_stime - usage.ru_stime
                faults[name] += after.ru_minflt - usage.ru_minflt
            results[name].append(out)
    load.append(os.getloadavg()[0])
    base = statistics.median(times[names[0]])
    print(f"{args.what}: {args.rounds} timed rounds after {args.warmup}, CPU s, load {load[0]:.1f} -> {load[1]:.1f}")
    for name in names:
        med = statistics.median(times[name])
        print(
            f"  {name:10s} median {med:.4f}  min {min(times[name]):.4f}  x {names[0]} {base / med:.3f}  "
            f"all {' '.join(f'{x:.3f}' for x in times[name])}  gc {gc_s[name] / args.rounds:.4f} s/round, "
            f"{gc_full[name]} full; system {system[name] / args.rounds:.4f} s/round, "
            f"{faults[name] // args.rounds} minor faults/round"
        )
    if args.what == "step":
        for name in names:
            print(f"  {name:10s} loss, grad norm: {results[name][: args.warmup + 2]}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for name in names:
            profiles[name].dump_stats(str(Path(args.profile) / f"{args.what}_{name}.prof"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
