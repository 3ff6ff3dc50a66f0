"""``mindspeed-rl flow-grpo``: Flow-GRPO / DanceGRPO on the text-to-image shapes demo (one process).

``mindspeed-rl flow-grpo --config examples/rl/flow_grpo_t2i_tiny_cpu.yaml --output-dir runs/flow-grpo
[key=value ...]`` trains the transformer of ``load_dir`` (the demo's SFT export) with the settings of
:class:`~mindspeed_rl.driver.flow_grpo.FlowGRPOConfig`, writes ``metrics.jsonl`` and the state file into
the output directory after each iteration, and resumes from that state when run again.
"""

from __future__ import annotations

import argparse
import sys


def add_flow_grpo(sub: argparse._SubParsersAction) -> None:
    """Add ``flow-grpo`` to the ``mindspeed-rl`` subcommands."""
    parser = sub.add_parser(
        "flow-grpo",
        help="Flow-GRPO / DanceGRPO on the tiny FLUX shapes demo or the Wan text-to-video demo",
        description="Sample along the flow-matching SDE recording each step's log-probability, score the images "
        "with a registered image reward, and update the transformer with the clipped objective on a fraction "
        "of the denoising steps. Resumes from the output directory's state file.",
    )
    parser.add_argument("--config", metavar="YAML", default=None, help="a recipe of FlowGRPOConfig keys")
    parser.add_argument("--output-dir", metavar="DIR", required=True, help="metrics and the resumable state go here")
    parser.add_argument(
        "--eval-interval", type=int, default=0, help="held-out check every N iterations (default 0: start and end)"
    )
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out check")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings that replace the recipe's")
    parser.set_defaults(func=run_flow_grpo)


def run_flow_grpo(args: argparse.Namespace) -> int:
    """Run the recipe; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_rl.cli.
    from mindspeed.config import load_config
    from mindspeed_rl.driver.flow_grpo import FlowGRPOConfig, train_flow_grpo

    config = load_config(FlowGRPOConfig, args.config, args.overrides)
    records = train_flow_grpo(config, args.output_dir, evaluate=not args.no_eval, eval_interval=args.eval_interval)
    evals = [r for r in records if "eval" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        checks = [
            k
            for k, v in first.items()
            if k not in ("eval", "iteration", "reward", "reward_se") and k in last and isinstance(v, float)
            if not k.startswith("train_") and not k.endswith(("_gain", "_gain_se"))
        ]
        sys.stdout.write(
            "held-out " + ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in checks) + "\n"
        )  # t2i: colour, position; t2v: colour, direction
        for prefix in ("", "train_"):
            keys = [k[len(prefix) : -len("_gain")] for k in last if k.startswith(prefix) and k.endswith("_gain")]
            keys = [k for k in keys if prefix or not k.startswith("train_")]
            if keys:
                gains = ", ".join(
                    f"{k} {last[f'{prefix}{k}_gain']:+.4f} (SE {last[f'{prefix}{k}_gain_se']:.4f})" for k in keys
                )
                sys.stdout.write(f"{'training' if prefix else 'held-out'} captions, paired change: {gains}\n")
    return 0
