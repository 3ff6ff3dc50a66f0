"""``mindspeed-rl``: the RL suite: GRPO and friends on Ray.

Subcommands are registered in :data:`COMMANDS` by the modules imported below;
``mindspeed-rl --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.registry import Registry
from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``.
COMMANDS: Registry[AddCommand] = Registry("mindspeed-rl command")

import mindspeed_rl.data.cli  # noqa: E402,F401  (registers make-data)
import mindspeed_rl.demo_model_cli  # noqa: E402,F401  (registers make-demo-model)
import mindspeed_rl.grpo_cli  # noqa: E402,F401  (registers grpo)


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-rl`` argument parser."""
    return build_suite_parser("mindspeed-rl", "mindspeed RL suite: GRPO and friends on Ray", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-rl`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    # Under ``python -m`` this file runs as __main__, a second copy of the module: the
    # subcommand modules register into mindspeed_rl.cli.COMMANDS, so run that copy's main.
    from mindspeed_rl.cli import main as registered_main

    sys.exit(registered_main())
