"""Benchmark ``mindspeed-mm train`` on a Wan video DiT against a plain diffusers training loop, and SP1 vs SP2 memory.

Part 1, side by side on one rank (fp32, the CPU, the same threads): both sides train the same
``WanTransformer3DModel`` (random weights, built here in code) on the same microbatches:

- ours: :func:`mindspeed_mm.trainer.loop.train` (what ``mindspeed-mm train`` runs with one
  process) on a feature cache of the samples, its own draws of timesteps and noise, with
  ``train.compile=--compile`` (default ``true``: the repeated blocks compiled; ``max-autotune``
  also times Inductor's GEMMs against ATen's; the compile runs in the first step, reported apart, in one thread
  so its CPU time is the process's, with a fresh Inductor cache per benchmark: the first run
  compiles cold, later ones hit the cache);
- diffusers: the loop of diffusers' flow-matching training examples (``train_dreambooth_sd3.py``
  and kin): ``FlowMatchEulerDiscreteScheduler``'s timesteps and ``get_sigmas``,
  ``(1 - sigma) x0 + sigma noise``, the model called with ``timestep``, the loss
  ``mean((pred - (noise - x0))^2)``, ``clip_grad_norm_``, ``torch.optim.AdamW``, given exactly
  our microbatches (latents, zero-padded text, timesteps, noise) prepared before it starts.

The losses of the two sides must agree (the same model, batch and update). Time is the loop
period (start of a step to the start of the next) after ``--warmup`` steps, as wall and CPU
time; every run is a fresh process (its peak RSS is its own); runs alternate ``--repeats``
times, a side's time is its best run's median step; "x diffusers" is the diffusers loop's time over
ours (above 1: ours is faster), for wall time and for CPU time (the steadier figure on a shared machine).

Part 2, sequence parallelism: a long video (``--long-shape`` latents) through one training step
at SP1 (one rank) and SP2 (two gloo ranks, Ulysses): per rank, the activations (the storages that
autograd saves for the backward, parameters aside), the tensor memory the forward leaves live and
the step's peak (:func:`mindspeed.metrics.measure_peak_memory`, dispatch tracking on the CPU; with
two ranks FSDP2's unsharded parameters and buffers count there, one fp32 rank trains without FSDP2). Usage::

    uv run --frozen python tools/bench/dit.py
    uv run --frozen python tools/bench/dit.py --quick        # a smoke run
    uv run --frozen python tools/bench/dit.py --parts 1 --compile false   # ours eager
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

from mindspeed_mm.demos.t2v_long import LONG_SHAPE, LONG_TEXT_LEN, LONG_WAN, write_random_features

WAN = "WanTransformer3DModel"
#: The benchmark's Wan: the long-video demo's (examples/mm/t2v_long_sp2.yaml): 8 heads of 32 (hidden 256),
#: 4 blocks, 16 latent channels.
MODEL = LONG_WAN


# ----------------------------------------------------------------------------- preparation


def _write_cache(directory: Path, shape: list[int], count: int, text_len: int, seed: int) -> Path:
    return write_random_features(directory, tuple(shape), count, text_len, MODEL["text_dim"], seed)


def prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """The model directory, the feature caches and the diffusers side's microbatches (our draws, in our order)."""
    import torch

    from mindspeed_mm.config import DiffusionConfig
    from mindspeed_mm.data.buckets import BucketOrder
    from mindspeed_mm.data.features import FeatureSet
    from mindspeed_mm.diffusion import FlowMatching
    from mindspeed_mm.models.dit import write_tiny_dit

    work = Path(spec["workdir"])
    model_dir = write_tiny_dit(work / "transformer", WAN, seed=0, **MODEL)
    per_step = spec["micro_batch"] * spec["grad_accum"]
    cache = _write_cache(work / "features", spec["shape"], per_step * spec["steps"], spec["text_len"], 1)
    long_cache = _write_cache(work / "long", spec["long_shape"], 2, spec["text_len"], 2)
    features = FeatureSet(cache)
    order = BucketOrder(features.shapes(), spec["micro_batch"], spec["grad_accum"], 1, spec["seed"], False)
    flow = FlowMatching(DiffusionConfig(**spec["diffusion"]))
    steps = []
    for step in range(1, spec["steps"] + 1):
        micro = []
        for j in range(spec["grad_accum"]):
            samples = [features[i] for i in order.indices(step, 0, j)]
            latents = torch.stack([s["latents"] for s in samples])
            pad = [s["text"].new_zeros(spec["text_len"] - len(s["text"]), MODEL["text_dim"]) for s in samples]
            text = torch.stack([torch.cat([s["text"], z]) for s, z in zip(samples, pad)])
            draw = flow.draw(flow.generator(spec["seed"], order.number(step, 0, j)), tuple(latents.shape))
            micro.append({"latents": latents, "text": text, "indices": draw.indices, "noise": draw.noise})
        steps.append(micro)
    torch.save(steps, work / "microbatches.pt")
    from diffusers import WanTransformer3DModel

    parameters = sum(p.numel() for p in WanTransformer3DModel.from_pretrained(str(model_dir)).parameters())
    return {
        "model_dir": str(model_dir),
        "cache": str(cache),
        "long": str(long_cache),
        "parameters": parameters,
        "tokens": _tokens(spec["shape"]),
    }


def _tokens(shape: list[int]) -> int:
    """Tokens of latents ``C, F, H, W`` under the model's 1 x 2 x 2 patches."""
    return shape[1] * (shape[2] // 2) * (shape[3] // 2)


# ----------------------------------------------------------------------------- children


def _overrides(spec: dict[str, Any], cache: str) -> list[str]:
    t = spec["train"]
    return [
        f"model.path={spec['model_dir']}",
        f"data.features={cache}",
        f"data.text_len={spec['text_len']}",
        "data.shuffle=false",
        f"train.steps={spec['steps']}",
        f"train.micro_batch_size={spec['micro_batch']}",
        f"train.gradient_accumulation_steps={spec['grad_accum']}",
        f"train.seed={spec['seed']}",
        "train.precision=fp32",
        "train.lr_decay_style=constant",
        f"train.compile={spec.get('compile', 'false')}",
        *[f"train.{k}={v}" for k, v in t.items()],
        *[f"diffusion.{k}={v}" for k, v in spec["diffusion"].items()],
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.loss_curve=false",
        f"logging.interval={spec['steps']}",
    ]


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """One ``mindspeed-mm train`` run (one rank)."""
    import torch

    torch.set_num_threads(spec["threads"])
    import diffusers  # noqa: F401  (imported before the baseline RSS, as on the diffusers side)

    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer import dit_task, loop

    base, load = memory_status(), os.getloadavg()[0]
    clock = StepClock(spec)
    microbatches = dit_task.DiTTask.microbatches

    def stamped(self: Any, step: int, rank: int) -> Any:
        clock.step_started(step)
        return microbatches(self, step, rank)

    dit_task.DiTTask.microbatches = stamped
    result = launch(loop.train, (load_mm_config(None, _overrides(spec, spec["cache"])),))
    (wall1, cpu1), (wall2, cpu2) = clock.starts[1], clock.starts[2]
    return {
        **clock.periods(),
        "first_step": [wall2 - wall1, cpu2 - cpu1],
        "losses": [r["loss"] for r in result.records],
        "threads": torch.get_num_threads(),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def child_diffusers(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain diffusers loop (as diffusers' flow-matching training examples write it) on our microbatches."""
    import torch

    torch.set_num_threads(spec["threads"])
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    base, load = memory_status(), os.getloadavg()[0]
    work = Path(spec["workdir"])
    steps = torch.load(work / "microbatches.pt", weights_only=False)
    t, d = spec["train"], spec["diffusion"]
    model = WanTransformer3DModel.from_pretrained(spec["model_dir"], torch_dtype=torch.float32)
    model.train()
    noise_scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=d["shift"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t["lr"], betas=(0.9, 0.999), weight_decay=t["weight_decay"], eps=1e-8)

    def get_sigmas(timesteps: torch.Tensor, n_dim: int) -> torch.Tensor:  # the examples' helper
        sigmas = noise_scheduler.sigmas.to(dtype=torch.float32)
        schedule_timesteps = noise_scheduler.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    clock, losses = StepClock(spec), []
    for number, micro in enumerate(steps, 1):
        clock.step_started(number)
        total = 0.0
        for batch in micro:
            latents, noise, text = batch["latents"], batch["noise"], batch["text"]
            timesteps = noise_scheduler.timesteps[batch["indices"]]
            sigmas = get_sigmas(timesteps, latents.ndim)
            noisy = (1.0 - sigmas) * latents + sigmas * noise
            pred = model(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=text, return_dict=False)[0]
            target = noise - latents
            loss = torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
            (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        torch.nn.utils.clip_grad_norm_(params, t["clip_grad"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    (wall1, cpu1), (wall2, cpu2) = clock.starts[1], clock.starts[2]
    return {
        **clock.periods(),
        "first_step": [wall2 - wall1, cpu2 - cpu1],
        "losses": losses,
        "threads": torch.get_num_threads(),
        "import_rss_mb": base["rss_mb"],
        "load": [load, os.getloadavg()[0]],
        **memory_status(),
    }


def _storage(param: Any) -> int:
    """The data pointer of a parameter's storage (a DTensor's local shard's)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.untyped_storage().data_ptr()


def _sp_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One training step of the long video on this rank: the activations its forward keeps and the step's peak."""
    import torch
    import torch.distributed as dist

    from mindspeed.metrics import measure_peak_memory
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.trainer.task import TASKS

    torch.set_num_threads(spec["threads"])
    # eager (train.compile=false, the recipe's default): the dispatch tracking of the memory is a torch dispatch
    # mode, which torch.compile refuses (fullgraph: "non-infra torch dispatch mode present")
    step = {**spec, "micro_batch": 1, "grad_accum": 1, "steps": 1, "compile": "false"}
    overrides = _overrides(step, spec["long"])
    config = load_mm_config(None, [*overrides, f"parallel.ulysses_parallel_size={world}"])
    task = TASKS.get("dit")(config, world)
    batch = task.microbatches(1, rank)[0]
    totals = task.counts([batch])
    dist.all_reduce(totals)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:  # activations: what autograd keeps, parameters aside
        storage = tensor.untyped_storage()
        weights = {_storage(p) for p in task.model.parameters()}  # FSDP2's unsharded ones while in use
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    start = time.perf_counter()
    with measure_peak_memory() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _ = task.loss(batch, totals)
    with measure_peak_memory() as backward:
        loss.backward()
    return {
        "activations_mib": sum(saved.values()) / 2**20,
        "forward_live_mib": forward.end_bytes / 2**20,
        "step_peak_mib": max(forward.peak_bytes, forward.end_bytes + backward.peak_bytes) / 2**20,
        "seconds": time.perf_counter() - start,
        "method": forward.method,
        "loss": float(loss.detach()) / world,
    }


CHILDREN = {"ours": child_ours, "diffusers": child_diffusers}


# ----------------------------------------------------------------------------- driver


def summarize(runs: list[dict[str, Any]], samples_per_step: int) -> dict[str, Any]:
    """One side over its repeats: a run's time is its median timed step's, the side's its best run's."""
    return {
        "step_s": min(statistics.median(r["periods"]) for r in runs),
        "cpu_step_s": min(statistics.median(r["cpu_periods"]) for r in runs),
        "samples_per_s": samples_per_step / min(statistics.median(r["periods"]) for r in runs),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "import_rss_mb": statistics.median(r["import_rss_mb"] for r in runs),
        "losses": runs[0]["losses"],
        "load": _child.load_range(runs),
        "runs_step_s": [round(statistics.median(r["periods"]), 3) for r in runs],
        "runs_cpu_step_s": [round(statistics.median(r["cpu_periods"]), 3) for r in runs],
        "first_step": [r.get("first_step") for r in runs],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per microbatch (default 2)")
    parser.add_argument("--grad-accum", type=int, default=2, help="microbatches per step (default 2)")
    parser.add_argument("--shape", default="16,5,16,16", help="latents C,F,H,W of part 1 (default 16,5,16,16)")
    long_shape = ",".join(map(str, LONG_SHAPE))
    parser.add_argument(
        "--long-shape", default=long_shape, help=f"latents of part 2's long video (default {long_shape}: the recipe's)"
    )
    parser.add_argument("--text-len", type=int, default=LONG_TEXT_LEN, help=f"text tokens (default {LONG_TEXT_LEN})")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (default 1)")
    parser.add_argument("--parts", default="1,2", help="1 (ours vs diffusers), 2 (SP memory) or both")
    parser.add_argument(
        "--compile",
        default="true",
        choices=["false", "true", "max-autotune"],
        help="ours' train.compile (default true; false: eager)",
    )
    parser.add_argument("--profile", action="store_true", help="write a CPU-time cProfile of each side's first run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5 steps (2 untimed), 1 repeat, small video")
    parser.add_argument("--workdir", default=None, help="model, data and logs (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    _child.add_record_args(parser)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.long_shape = 5, 2, 1, "16,3,16,16"
    if args.steps < args.warmup + 3:
        parser.error(f"--steps={args.steps} leaves fewer than 2 timed steps after --warmup={args.warmup}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the tables (or, with ``--child``, one side of part 1)."""
    args = parse_args(argv)
    if args.child:
        return _child.child_main(CHILDREN, args.child, args.child_spec)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-dit-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "workdir": str(work),
        "steps": args.steps,
        "warmup": args.warmup,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "threads": args.threads,
        "seed": 1234,
        "shape": [int(x) for x in args.shape.split(",")],
        "long_shape": [int(x) for x in args.long_shape.split(",")],
        "text_len": args.text_len,
        "compile": args.compile,
        "train": {"lr": 1e-4, "weight_decay": 0.0, "clip_grad": 1.0, "lr_warmup_steps": 0},
        "diffusion": {"shift": 3.0, "timestep_sampling": "logit_normal", "text_dropout": 0.0},
    }
    started, load = time.perf_counter(), _child.LoadRecord(args.max_load)
    write = sys.stdout.write
    write(f"load average before: {load.before:.1f}\n")
    facts = prepare(spec)
    spec.update(model_dir=facts["model_dir"], cache=facts["cache"], long=facts["long"])
    out: dict[str, Any] = {"facts": facts}
    tables = []
    if "1" in args.parts.split(","):
        out["part1"] = _part1(args, spec, facts, work, load)
        tables.append(out["part1"]["table"])
    if "2" in args.parts.split(","):
        out["part2"], table = _part2(spec, facts, load)
        tables.append(table)
    noisy = any(r["noisy"] for r in out.get("part1", {}).get("results", {}).values()) or load.busy()
    footer = (
        f"{load.header(noisy)}; {time.perf_counter() - started:.0f} s; torch {version('torch')}, "
        f"diffusers {version('diffusers')}; workdir {work}\n"
    )
    write("\n" + footer)
    if args.json:
        Path(args.json).write_text(
            json.dumps({**out, "load": [load.before, _child.load_average()]}, indent=2, default=str)
        )
    return load.write_table(args.table, "".join(tables) + "\n" + footer, noisy)


def _part1(
    args: argparse.Namespace, spec: dict[str, Any], facts: dict[str, Any], work: Path, load: _child.LoadRecord
) -> dict[str, Any]:
    sides = {"ours (mindspeed-mm train)": "ours", "diffusers loop (examples' flow matching)": "diffusers"}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for number, (name, kind) in enumerate(sides.items()):
            child = dict(spec)
            if args.profile and repeat == 0:
                child["profile"] = str(work / f"profile_{kind}.prof")
            # Inductor compiles in this process (its CPU time counted), into a cache of this benchmark's own
            env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
            runs[name].append(_child.run_child(__file__, kind, child, work / f"run_{repeat}_{number}.log", env))
    per_step = args.micro_batch * args.grad_accum
    results = {name: {**summarize(r, per_step), "noisy": load.noisy(r)} for name, r in runs.items()}
    ours, ref = results.values()
    gap = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ref["losses"]))
    if gap > 1e-4:
        raise SystemExit(f"the two sides' losses differ by rel {gap:.1e}: they did not train the same; see {work}")
    lines: list[str] = []
    write = lines.append
    write(
        f"\nPart 1: Wan {facts['parameters'] / 1e6:.1f} M parameters, fp32, latents {args.shape} "
        f"({facts['tokens']} tokens a sample, {args.text_len} text tokens), {args.steps} steps ({args.warmup} untimed) "
        f"of {args.micro_batch} samples x {args.grad_accum} microbatches, torch threads {args.threads}, best of "
        f"{args.repeats} run(s) of the median step; ours train.compile={args.compile}; losses agree to rel {gap:.1e}\n\n"
        "| run | step s | x diffusers | CPU s | x diffusers | peak RSS MB | x diffusers | peak - imports MB "
        "| loss step 1 | last loss | load | step s (CPU s) of each run | step 1 s wall / CPU of each run |\n"
        + "|---" * 13
        + "|\n"
    )
    for name, r in results.items():
        write(
            f"| {_child.mark(name, r['noisy'])} | {r['step_s']:.3f} | {ref['step_s'] / r['step_s']:.2f} "
            f"| {r['cpu_step_s']:.3f} "
            f"| {ref['cpu_step_s'] / r['cpu_step_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / ref['peak_rss_mb']:.2f} "
            f"| {r['peak_rss_mb'] - r['import_rss_mb']:.0f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} "
            f"| {r['load'][0]:.1f} -> {r['load'][1]:.1f} "
            f"| {', '.join(f'{w} ({c})' for w, c in zip(r['runs_step_s'], r['runs_cpu_step_s']))} "
            f"| {', '.join(f'{f[0]:.1f} / {f[1]:.1f}' if f else '-' for f in r['first_step'])} |\n"
        )
    write(
        f"\nours vs the diffusers loop: {ref['step_s'] / ours['step_s']:.2f}x by wall time, "
        f"{ref['cpu_step_s'] / ours['cpu_step_s']:.2f}x by CPU time; peak RSS {ours['peak_rss_mb']:.0f} vs "
        f"{ref['peak_rss_mb']:.0f} MB; load average {min(ours['load'][0], ref['load'][0]):.1f} -> "
        f"{max(ours['load'][1], ref['load'][1]):.1f}\n"
    )
    sys.stdout.write("".join(lines))
    return {"results": results, "runs": runs, "loss_gap": gap, "table": "".join(lines)}


def _part2(spec: dict[str, Any], facts: dict[str, Any], load: _child.LoadRecord) -> tuple[list[dict[str, Any]], str]:
    """Part 2's rows (SP1, SP2) and their table."""
    from mindspeed.testing.distributed import run_distributed

    shape = spec["long_shape"]
    tokens = _tokens(shape)
    rows = []
    for sp in (1, 2):
        ranks = run_distributed(_sp_rank, sp, spec, timeout=1800)
        rows.append(
            {
                "sp": sp,
                **{k: max(r[k] for r in ranks) for k in ranks[0] if k != "method"},
                "method": ranks[0]["method"],
                "losses": [r["loss"] for r in ranks],
            }
        )
    lines: list[str] = []
    write = lines.append
    write(
        f"\nPart 2: one training step of a long video (latents {shape}: {tokens} tokens, {spec['text_len']} text "
        f"tokens), Wan {facts['parameters'] / 1e6:.1f} M, fp32, the largest rank; tensor memory by "
        f"{rows[0]['method']} tracking\n\n"
        "| SP | activations MiB/rank | x SP1 | live after forward MiB | x SP1 | step peak MiB | x SP1 | step s | loss |\n"
        + "|---" * 9
        + "|\n"
    )
    base = rows[0]
    for r in rows:
        write(
            f"| {_child.mark(str(r['sp']), load.busy())} | {r['activations_mib']:.1f} | {r['activations_mib'] / base['activations_mib']:.2f} "
            f"| {r['forward_live_mib']:.1f} | {r['forward_live_mib'] / base['forward_live_mib']:.2f} "
            f"| {r['step_peak_mib']:.1f} | {r['step_peak_mib'] / base['step_peak_mib']:.2f} "
            f"| {r['seconds']:.1f} | {r['loss']:.5f} |\n"
        )
    sys.stdout.write("".join(lines))
    return rows, "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
