"""The ``mindspeed-llm convert-ckpt`` subcommand: flags derived from :class:`ConvertConfig`.

Every field of the config is one flag (``load_dir`` -> ``--load-dir``), with its help text from
the config's docstring, so the CLI and the Python API cannot drift apart. Bad input of any kind
raises ``ValueError`` before anything is written; the suite CLI turns it into one line on
standard error and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mindspeed.checkpointing import run_lock
from mindspeed.checkpointing.hf_dtype import SAVE_HF_DTYPES
from mindspeed.suite_cli import OUTPUT_DIR_ALIASES, add_dataclass_flags
from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint

#: Flags with a fixed set of values.
_CHOICES = {
    "load_model_type": ("hf", "mg"),
    "save_model_type": ("mg", "hf"),
    "ckpt_format": ("torch", "torch_dist"),
    "save_hf_dtype": SAVE_HF_DTYPES,
}


def add_convert_ckpt(sub: argparse._SubParsersAction) -> None:
    """Add ``convert-ckpt`` to the ``mindspeed-llm`` subcommands."""
    parser = sub.add_parser(
        "convert-ckpt",
        help="convert checkpoints between Hugging Face and Megatron (any TP/PP/EP/VPP)",
        description="Convert a Hugging Face checkpoint to Megatron shards, back, or between Megatron layouts. "
        "The whole mapping is planned and checked first; output is written to a temporary "
        "directory and renamed at the end.",
    )
    # --save-dir pairs with --load-dir as in Megatron's and MindSpeed's converters; --output-dir as everywhere.
    add_dataclass_flags(parser, ConvertConfig, _CHOICES, OUTPUT_DIR_ALIASES)
    parser.set_defaults(func=run_convert_ckpt)


def run_convert_ckpt(args: argparse.Namespace) -> int:
    """Run ``convert-ckpt`` from parsed arguments; returns the exit status."""
    names = {f.name for f in dataclasses.fields(ConvertConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for key in ("load_dir", "save_dir", "hf_cfg_dir", "lora_load"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    # A ValueError (bad input, nothing written) becomes one line on stderr and exit status 2 (suite_cli).
    # One conversion per output directory; the lock sits next to it (the output is renamed into place).
    with run_lock(values.get("save_dir"), "--save-dir", beside=True):
        report = convert_checkpoint(ConvertConfig(**values))
    sys.stdout.write(report.describe() + "\n")
    return 0
