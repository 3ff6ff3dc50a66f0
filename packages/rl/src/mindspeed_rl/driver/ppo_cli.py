"""``mindspeed-rl ppo --config recipe.yaml [--print-config] [key=value ...]``: PPO with a critic on Ray.

The recipe is a :class:`~mindspeed_rl.config.ppo.PPOConfig` (a GRPO recipe plus ``critic``, GAE
by default); the run is ``grpo``'s (:mod:`mindspeed_rl.driver.grpo_cli`: the same logs, checkpoints,
resume, signals and exit statuses) with :class:`~mindspeed_rl.driver.ppo_runner.PPORunner` as its driver.
A bad key or value exits 2 with the key and the fix, before any worker starts.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from mindspeed.checkpointing import run_lock
from mindspeed.config import ConfigError, to_dict
from mindspeed_rl.driver.grpo_cli import _run_grpo


def add_ppo(sub: argparse._SubParsersAction) -> None:
    """Add ``ppo`` to the ``mindspeed-rl`` subcommands."""
    parser = sub.add_parser(
        "ppo",
        help="train a policy with PPO and a critic (GAE) on Ray",
        description="PPO on Ray: actor and critic (megatron-core, co-located), reference, rollout engines and "
        "rewards; GAE advantages, KL in the reward (algorithm.kl_ctrl). Recipe keys: docs/rl/ppo.md.",
    )
    parser.add_argument("--config", help="the recipe (YAML)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. critic.lr=1e-5")
    parser.set_defaults(func=run_ppo)


def run_ppo(args: argparse.Namespace) -> int:
    """Run the recipe; returns the exit status."""
    from mindspeed_rl.config.ppo import load_ppo_config
    from mindspeed_rl.driver.ppo_runner import PPORunner

    try:
        config = load_ppo_config(args.config, args.overrides)
    except ConfigError as err:
        raise ValueError(str(err)) from err
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False))
        return 0
    with run_lock(config.checkpoint.save):
        return _run_grpo(config, PPORunner, "ppo")
