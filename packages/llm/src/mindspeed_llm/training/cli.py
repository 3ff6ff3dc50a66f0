"""``mindspeed-llm pretrain|sft|dpo|rm --config recipe.yaml [key=value ...]``: the training commands.

The recipe and the overrides build a :class:`~mindspeed_llm.training.config.PretrainConfig`
(strict: an unknown key is an error with a suggestion), which is checked against the world
size before any rank starts. ``--nproc-per-node N`` spawns N local ranks; ``--nnodes``,
``--node-rank``, ``--master-addr`` / ``--master-port`` (or ``--rdzv-endpoint``) place them among
several nodes as torchrun's flags do (:mod:`mindspeed.nodes`); under ``torchrun`` the command is one
rank of the torchrun launch (multi-node included).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import yaml

from mindspeed.checkpointing import run_lock
from mindspeed.config import ConfigError, to_dict
from mindspeed.launch import launch
from mindspeed.log import get_logger
from mindspeed.nodes import add_launch_arguments, nodes_from_args
from mindspeed_llm.training.config import load_pretrain_config
from mindspeed_llm.training.hf import apply_load_hf
from mindspeed_llm.training.trainer import pretrain

logger = get_logger(__name__)


#: command -> (help, description) of the training commands; all share one recipe format.
_COMMANDS = {
    "pretrain": (
        "pretrain a GPT on megatron-core (any TP/PP/VPP/DP/EP layout, CPU included)",
        "Pretrain a GPT with megatron-core from a YAML recipe and key=value overrides "
        "(e.g. train.steps=100 parallel.tp=2). Checkpoints are megatron-core distributed "
        "checkpoints; a run resumes from the newest one in checkpoint.save.",
    ),
    "sft": (
        "supervised fine-tuning on instruction data (full or LoRA/QLoRA; packed sequences)",
        "Fine-tune on instruction data from preprocess-data (data.prefixes = its --output-prefix): the loss is "
        "on response tokens only, samples are packed with attention reset at their boundaries. Start from a "
        "Hugging Face directory with checkpoint.load_hf=DIR; export with checkpoint.save_hf=DIR.",
    ),
    "dpo": (
        "direct preference optimisation on pairwise data, against a frozen reference model",
        "Train with DPO on pairwise data from preprocess-data (AlpacaStylePairwiseHandler ...): dpo.beta, "
        "dpo.label_smoothing, dpo.loss_type; the reference is the starting model (checkpoint.load_hf or "
        "checkpoint.load) unless dpo.ref_model names another.",
    ),
    "rm": (
        "train an outcome reward model (Bradley-Terry) on pairwise data",
        "Train a reward model on pairwise data from preprocess-data (AlpacaStylePairwiseHandler ...): the "
        "GPT's output layer becomes a scalar score head, the reward of an answer is its score at the last "
        "token, the loss -log sigmoid(r_chosen - r_rejected - rm.margin) (+ rm.center_rewards_coefficient). "
        "Start from a Hugging Face directory with checkpoint.load_hf=DIR.",
    ),
}


def _add_training_command(sub: argparse._SubParsersAction, stage: str) -> None:
    help_text, description = _COMMANDS[stage]
    parser = sub.add_parser(stage, help=help_text, description=description)
    parser.add_argument("--config", help="YAML recipe (default: all defaults)")
    add_launch_arguments(parser)
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-3")
    parser.set_defaults(func=run_pretrain, stage=stage)


def add_pretrain(sub: argparse._SubParsersAction) -> None:
    """Add ``pretrain`` to the ``mindspeed-llm`` subcommands."""
    _add_training_command(sub, "pretrain")


def add_sft(sub: argparse._SubParsersAction) -> None:
    """Add ``sft`` to the ``mindspeed-llm`` subcommands."""
    _add_training_command(sub, "sft")


def add_dpo(sub: argparse._SubParsersAction) -> None:
    """Add ``dpo`` to the ``mindspeed-llm`` subcommands."""
    _add_training_command(sub, "dpo")


def add_rm(sub: argparse._SubParsersAction) -> None:
    """Add ``rm`` to the ``mindspeed-llm`` subcommands."""
    _add_training_command(sub, "rm")


def _rank_main(config: object) -> object:
    return pretrain(config)


def run_pretrain(args: argparse.Namespace) -> int:
    """Run ``pretrain`` from parsed arguments; returns the exit status."""
    nodes = nodes_from_args(args)
    stage = getattr(args, "stage", "pretrain")
    config = load_pretrain_config(args.config, args.overrides)
    if config.stage not in ("pretrain", stage):
        raise ConfigError(
            f"the recipe says stage: {config.stage}; run it with `mindspeed-llm {config.stage}` rather than `{stage}`"
        )
    config = dataclasses.replace(config, stage=stage)
    config = apply_load_hf(config)
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0
    config.check(nodes.world_size(args.nproc_per_node))
    # One run per save directory: node 0's launcher (or torchrun's rank 0) holds its lock while the ranks run.
    with run_lock(config.checkpoint.save, node_rank=nodes.node_rank):
        result = launch(
            _rank_main, (config,), nproc_per_node=args.nproc_per_node, log_level=args.log_level, nodes=nodes
        )
    if result is not None and result.stopped:
        logger.error("pretrain stopped early: %s", result.stopped)
        return 1
    return result.exit_code if result is not None else 0
