"""The GRPO actor's update alone, on the batch of ``grpo.py``'s default case (CPU time per update).

Builds ours as ``grpo.py`` does (the same model directory, prompts and recipe overrides), runs one
``grpo_step`` to get a rollout batch, gives it random advantages (a random-weight model scores 0
on every sample, so the real ones are all 0) and times ``Actor.update`` on that batch repeatedly in
this process: CPU and wall seconds per update, median of ``--updates`` after one untimed. The
update is ~half of our step, so this is the quick way to A/B the update side in one process
(``grpo.py`` runs whole steps against TRL in fresh processes). Usage::

    uv run --frozen python tools/bench/grpo_update.py                    # micro batch 8
    uv run --frozen python tools/bench/grpo_update.py --micro-batch 32
    uv run --frozen python tools/bench/grpo_update.py --profile          # cProfile of 3 updates
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpo  # tools/bench/grpo.py: the script's folder is on sys.path


def build(spec: dict[str, Any], overrides: Sequence[str]) -> Any:
    """``build_context`` of ``grpo.py``'s recipe (``child_ours``'s overrides, plus ``overrides``)."""
    from mindspeed_rl.config.grpo import load_grpo_config
    from mindspeed_rl.driver.trainer import build_context

    tokens = spec["max_new_tokens"]
    config = load_grpo_config(
        None,
        [
            f"actor.model={spec['model_dir']}",
            f"actor.lr={spec['lr']}",
            f"actor.micro_batch_size={spec['micro_batch']}",
            "actor.clip_grad=1.0",
            "actor.lr_decay_style=constant",
            f"rollout.n={spec['n']}",
            f"rollout.max_new_tokens={tokens}",
            "rollout.temperature=1.0",
            f"rollout.max_prompt_length={grpo.max_positions(spec) - tokens}",
            f"rollout.max_num_seqs={spec['global_batch'] * spec['n']}",
            f"train.global_batch={spec['global_batch']}",
            f"train.steps={spec['steps']}",
            f"train.seed={spec['seed']}",
            "algorithm.kl_coef=0",
            "algorithm.loss_agg_mode=token-mean",
            f"data.path={spec['prompts_path']}",
            "data.shuffle=false",
            "data.prompt_format=chat",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.reward_curve=false",
            *overrides,
        ],
    )
    return build_context(config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, default=8, help="actor.micro_batch_size (default 8)")
    parser.add_argument("--updates", type=int, default=6, help="timed updates (default 6, after one untimed)")
    parser.add_argument("--profile", action="store_true", help="print a CPU-time cProfile of 3 more updates")
    parser.add_argument("--workdir", default=None, help="model and prompts (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", help="more recipe overrides (key=value)")
    args = parser.parse_args(argv)
    if (4 * 8) % args.micro_batch:
        raise SystemExit(f"--micro-batch={args.micro_batch} must divide the 32 rows of a step")
    import torch

    torch.set_num_threads(1)
    from mindspeed_rl.driver.trainer import grpo_step
    from mindspeed_rl.models.memory import freeze_startup_objects

    spec = {
        "workdir": args.workdir or tempfile.mkdtemp(prefix="bench-grpo-update-"),
        "size": "tiny",
        "steps": 2,
        "global_batch": 4,
        "n": 8,
        "micro_batch": args.micro_batch,
        "max_new_tokens": 64,
        "lr": 1e-5,
        "seed": 1234,
        "prompt_tokens": 0,
    }
    spec.update(grpo.prepare(spec))
    ctx = build(spec, args.overrides)
    freeze_startup_objects()
    generate, update, batch = ctx.engine.generate, ctx.actor.update, []

    def every_token(prompts: Any, params: Any) -> Any:  # as grpo.py: every response max_new_tokens long
        return generate(prompts, [dataclasses.replace(p, ignore_eos=True) for p in params])

    def capture(*call: Any, **kwargs: Any) -> Any:
        batch.append((call, kwargs))
        return update(*call, **kwargs)

    ctx.engine.generate, ctx.actor.update = every_token, capture
    grpo_step(ctx)
    call, kwargs = batch[0]
    advantages = torch.randn(call[2].shape, generator=torch.Generator().manual_seed(0))
    call = (*call[:2], advantages, *call[3:])
    cpu, wall = [], []
    for _ in range(args.updates + 1):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        metrics = update(*call, **kwargs)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    load = os.getloadavg()
    sys.stdout.write(
        f"micro batch {args.micro_batch}: update CPU s median {statistics.median(cpu[1:]):.3f} "
        f"(min {min(cpu[1:]):.3f}), wall s median {statistics.median(wall[1:]):.3f}; loss "
        f"{metrics['loss']:.8f}, grad norm {metrics['grad_norm']:.6f}; load average {load[0]:.1f}\n"
    )
    if args.profile:
        profile = cProfile.Profile(time.process_time)
        profile.enable()
        for _ in range(3):
            update(*call, **kwargs)
        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
