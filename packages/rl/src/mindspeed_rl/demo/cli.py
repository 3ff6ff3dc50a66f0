"""The ``mindspeed-rl make-demo-model`` subcommand: write the demo starting policy of the GRPO examples.

``mindspeed-rl make-demo-model --output-dir runs/demo-policy`` writes a tiny Llama (Hugging Face
directory) warm-started on the shipped arithmetic prompts, see :mod:`mindspeed_rl.demo.model`.
A recipe may name it as ``actor.model`` (``actor.model: demo`` builds one on first use).
"""

from __future__ import annotations

import argparse
import sys
import time

from mindspeed.suite_cli import add_renamed_flag


def add_make_demo_model(sub: argparse._SubParsersAction) -> None:
    """Add ``make-demo-model`` to the ``mindspeed-rl`` subcommands."""
    parser = sub.add_parser(
        "make-demo-model",
        help="write the tiny demo starting policy (Hugging Face directory)",
        description="Fit a tiny Llama on the shipped arithmetic prompts for a few hundred steps "
        "(about a minute on one CPU core) so that GRPO starts from a policy that is right "
        "some of the time. Same seed, same weights. Written atomically.",
    )
    # A required group: the earlier, hidden --out fills --output-dir too (a required flag would still be asked for).
    output = parser.add_mutually_exclusive_group(required=True)
    output.add_argument("--output-dir", metavar="DIR", help="the directory to write (new or empty)")
    add_renamed_flag(output, "--out", "--output-dir")  # its earlier name
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the fit (default 0)")
    parser.add_argument(
        "--fit-steps",
        type=int,
        default=None,
        help="supervised steps of the warm start (default: the builder's; more: a better start)",
    )
    parser.set_defaults(func=run_make_demo_model)


def run_make_demo_model(args: argparse.Namespace) -> int:
    """Build and write the policy; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_rl.cli.
    from dataclasses import replace

    from mindspeed_rl.demo.model import DemoPolicySettings, build_demo_policy

    settings = DemoPolicySettings()
    if args.fit_steps is not None:
        if args.fit_steps < 0:
            raise ValueError(f"--fit-steps {args.fit_steps} must be >= 0")
        settings = replace(settings, fit_steps=args.fit_steps)
    started = time.perf_counter()
    out = build_demo_policy(args.output_dir, seed=args.seed, settings=settings)
    sys.stdout.write(f"wrote the demo policy to {out} in {time.perf_counter() - started:.1f} s\n")
    return 0
