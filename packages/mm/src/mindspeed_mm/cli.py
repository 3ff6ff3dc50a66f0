"""``mindspeed-mm``: the multimodal suite: vision-language and video/image generation training.

Subcommands are the literal table :data:`COMMANDS` (their modules never import this one);
``mindspeed-mm --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite
from mindspeed_mm.convert_cli import add_convert
from mindspeed_mm.evaluate_cli import add_evaluate
from mindspeed_mm.extract_cli import add_extract_features
from mindspeed_mm.generate_cli import add_generate
from mindspeed_mm.train_cli import add_train

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``, in help order.
COMMANDS: dict[str, AddCommand] = {
    "train": add_train,
    "generate": add_generate,
    "evaluate": add_evaluate,
    "convert": add_convert,
    "extract-features": add_extract_features,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-mm`` argument parser."""
    return build_suite_parser(
        "mindspeed-mm", "mindspeed multimodal suite: vision-language and video/image generation training", COMMANDS
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-mm`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
