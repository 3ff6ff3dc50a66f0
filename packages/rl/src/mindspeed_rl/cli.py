"""``mindspeed-rl``: the RL suite: GRPO and friends on Ray.

Subcommands are the literal table :data:`COMMANDS` (their modules never import this one);
``mindspeed-rl --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite
from mindspeed_rl.data.cli import add_make_data
from mindspeed_rl.demo.cli import add_make_demo_model
from mindspeed_rl.driver.flow_grpo_cli import add_flow_grpo
from mindspeed_rl.driver.grpo_cli import add_grpo
from mindspeed_rl.driver.ppo_cli import add_ppo

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``, in help order.
COMMANDS: dict[str, AddCommand] = {
    "make-data": add_make_data,
    "make-demo-model": add_make_demo_model,
    "grpo": add_grpo,
    "ppo": add_ppo,
    "flow-grpo": add_flow_grpo,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-rl`` argument parser."""
    return build_suite_parser("mindspeed-rl", "mindspeed RL suite: GRPO and friends on Ray", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-rl`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
