"""``mindspeed-mm``: the multimodal suite: vision-language and video/image generation training.

Subcommands are registered in :data:`COMMANDS` by the modules imported below;
``mindspeed-mm --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.registry import Registry
from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``.
COMMANDS: Registry[AddCommand] = Registry("mindspeed-mm command")

import mindspeed_mm.train_cli  # noqa: E402,F401  (registers train)


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-mm`` argument parser."""
    return build_suite_parser("mindspeed-mm", "mindspeed multimodal suite: vision-language and video/image generation training", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-mm`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    # Under ``python -m`` this file runs as __main__, a second copy of the module: the
    # subcommand modules register into mindspeed_mm.cli.COMMANDS, so run that copy's main.
    from mindspeed_mm.cli import main as registered_main

    sys.exit(registered_main())
