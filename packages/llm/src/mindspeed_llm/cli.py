"""``mindspeed-llm``: the LLM suite: checkpoint conversion, data preprocessing, pretraining, fine-tuning, generation, evaluation.

Subcommands are registered in :data:`COMMANDS` by the modules imported below;
``mindspeed-llm --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.registry import Registry
from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``.
COMMANDS: Registry[AddCommand] = Registry("mindspeed-llm command")

import mindspeed_llm.checkpoint.cli  # noqa: E402,F401  (registers convert-ckpt)
import mindspeed_llm.data.cli  # noqa: E402,F401  (registers preprocess-data)
import mindspeed_llm.evaluation.cli  # noqa: E402,F401  (registers evaluate)
import mindspeed_llm.inference.cli  # noqa: E402,F401  (registers generate)
import mindspeed_llm.training.cli  # noqa: E402,F401  (registers pretrain)


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-llm`` argument parser."""
    return build_suite_parser("mindspeed-llm", "mindspeed LLM suite: checkpoint conversion, data preprocessing, pretraining, fine-tuning, generation, evaluation", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-llm`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    # Under ``python -m`` this file runs as __main__, a second copy of the module: the
    # subcommand modules register into mindspeed_llm.cli.COMMANDS, so run that copy's main.
    from mindspeed_llm.cli import main as registered_main

    sys.exit(registered_main())
