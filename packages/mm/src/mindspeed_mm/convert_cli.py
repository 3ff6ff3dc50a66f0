"""``mindspeed-mm convert``: flags derived from :class:`~mindspeed_mm.convert.ConvertConfig`.

Every field of the config is one flag (``load_dir`` -> ``--load-dir``) with its help from the
config's docstring. Bad input of any kind raises ``ValueError`` before anything is written; the
suite CLI turns it into one line on standard error and exit status 2 (as ``mindspeed-llm
convert-ckpt``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mindspeed.suite_cli import OUTPUT_DIR_ALIASES, add_dataclass_flags
from mindspeed_mm.convert.config import DTYPES, FORMATS, ConvertConfig


def add_convert(sub: argparse._SubParsersAction) -> None:
    """Add ``convert`` to the ``mindspeed-mm`` subcommands."""
    parser = sub.add_parser(
        "convert",
        help="convert DCP training checkpoints <-> Hugging Face / diffusers directories, LoRA <-> PEFT / diffusers "
        "LoRA adapters, merge",
        description="dcp -> hf (LoRA merged), hf -> dcp, dcp -> peft, peft -> dcp, peft -> hf (merge); for diffusion "
        "transformers also dcp -> lora, lora -> dcp, lora -> hf (diffusers' pytorch_lora_weights.safetensors). "
        "A train.ema checkpoint gives its moving averages unless --no-ema. Every tensor "
        "is matched on both sides first (an unmatched one is an error naming it); the output is written "
        "to a temporary directory and renamed at the end.",
    )
    # --save-dir pairs with --load-dir as in Megatron's and MindSpeed's converters; --output-dir as everywhere.
    add_dataclass_flags(
        parser, ConvertConfig, {"load_format": FORMATS, "save_format": FORMATS, "dtype": DTYPES}, OUTPUT_DIR_ALIASES
    )
    parser.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """Run ``convert`` from parsed arguments; returns the exit status."""
    # Lazy: keeps torch out of the start-up of mindspeed_mm.cli.
    from mindspeed.checkpointing import run_lock
    from mindspeed_mm.convert.convert import convert

    names = {f.name for f in dataclasses.fields(ConvertConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for key in ("load_dir", "save_dir", "base_dir"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    # One conversion per output directory; the lock sits next to it (the output is renamed into place).
    with run_lock(values.get("save_dir"), "--save-dir", beside=True):
        report = convert(ConvertConfig(**values))  # a ValueError: one line on stderr, exit 2 (suite_cli)
    sys.stdout.write(report.describe() + "\n")
    return 0
