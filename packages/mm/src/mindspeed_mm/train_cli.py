"""``mindspeed-mm train --config recipe.yaml [key=value ...]``: train a VLM or a diffusion transformer under FSDP2.

The recipe and the overrides build a :class:`~mindspeed_mm.config.MMConfig` (strict: an unknown
key is an error with a suggestion), checked against the world size before any rank starts.
``--nproc-per-node N`` spawns N local ranks, ``--nnodes`` / ``--node-rank`` / ``--master-addr`` place
them among nodes as torchrun's flags do (:mod:`mindspeed.nodes`); under ``torchrun`` the command is one rank.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from mindspeed.checkpointing import run_lock
from mindspeed.config import to_dict
from mindspeed.log import get_logger
from mindspeed.nodes import add_launch_arguments, nodes_from_args

logger = get_logger(__name__)


def add_train(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``mindspeed-mm`` subcommands."""
    parser = sub.add_parser(
        "train",
        help="train a vision-language model or a diffusion transformer (library classes under FSDP2)",
        description="Fine-tune a transformers vision-language model from a local directory on mllm_format data "
        "(messages with <image> placeholders plus images), or train a diffusers transformer (Wan, FLUX) "
        "with flow matching on a feature cache (data.features), under torch FSDP2; the model directory's "
        "config.json picks which. Checkpoints are torch DCP in checkpoint.save (a run resumes from the "
        "newest complete one; SIGTERM and Ctrl-C save and exit 143 / 130); checkpoint.save_hf exports the "
        "result.",
    )
    parser.add_argument("--config", help="YAML recipe (default: all defaults)")
    add_launch_arguments(parser)
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-5")
    parser.set_defaults(func=run_train)


def _rank_main(config: object) -> object:
    # Lazy: keeps torch out of the start-up of mindspeed_mm.cli.
    from mindspeed_mm.trainer.loop import train

    return train(config)


def run_train(args: argparse.Namespace) -> int:
    """Run ``train`` from parsed arguments; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_mm.cli.
    from mindspeed.launch import launch
    from mindspeed_mm.config import load_mm_config
    from mindspeed_mm.demos.names import resolve_demo

    nodes = nodes_from_args(args)
    config = resolve_demo(load_mm_config(args.config, args.overrides))
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0
    config.check(nodes.world_size(args.nproc_per_node))
    # One run per save directory: node 0's launcher (or torchrun's rank 0) holds its lock while the ranks run.
    with run_lock(config.checkpoint.save, node_rank=nodes.node_rank):
        result = launch(
            _rank_main, (config,), nproc_per_node=args.nproc_per_node, log_level=args.log_level, nodes=nodes
        )
    if result is not None and result.stopped:  # non-finite steps in a row, or a save refused for NaN/Inf
        logger.error("train stopped early: %s", result.stopped)
    # 143 / 130 after SIGTERM / Ctrl-C (saved first; the same command resumes), 1 when stopped, else 0.
    return result.exit_code if result is not None else 0
