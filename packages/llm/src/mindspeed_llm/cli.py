"""``mindspeed-llm``: the LLM suite: checkpoint conversion, data preprocessing, pretraining, fine-tuning, generation, evaluation.

Subcommands are the literal table :data:`COMMANDS` (their modules never import this one);
``mindspeed-llm --help`` lists the ones this version has.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.suite_cli import AddCommand, build_suite_parser, run_suite
from mindspeed_llm.checkpoint.cli import add_convert_ckpt
from mindspeed_llm.data.cli import add_preprocess_data
from mindspeed_llm.evaluation.cli import add_evaluate
from mindspeed_llm.inference.cli import add_generate
from mindspeed_llm.training.cli import add_dpo, add_pretrain, add_rm, add_sft
from mindspeed_llm.training.quickstart import add_quickstart

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``, in help order.
COMMANDS: dict[str, AddCommand] = {
    "convert-ckpt": add_convert_ckpt,
    "preprocess-data": add_preprocess_data,
    "evaluate": add_evaluate,
    "generate": add_generate,
    "pretrain": add_pretrain,
    "sft": add_sft,
    "dpo": add_dpo,
    "rm": add_rm,
    "quickstart": add_quickstart,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-llm`` argument parser."""
    return build_suite_parser(
        "mindspeed-llm",
        "mindspeed LLM suite: checkpoint conversion, data preprocessing, pretraining, fine-tuning, generation, evaluation",
        COMMANDS,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-llm`` command."""
    return run_suite(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
