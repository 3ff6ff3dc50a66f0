"""The ``mindspeed-llm convert-ckpt`` subcommand: flags derived from :class:`ConvertConfig`.

Every field of the config is one flag (``load_dir`` -> ``--load-dir``), with its help text from
the config's docstring, so the CLI and the Python API cannot drift apart. Bad input of any kind
raises ``ValueError`` before anything is written; the suite CLI turns it into one line on
standard error and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from pathlib import Path

from mindspeed_llm.checkpoint.convert import ConvertConfig, convert_checkpoint
from mindspeed_llm.cli import COMMANDS

#: Flags with a fixed set of values.
_CHOICES = {"load_model_type": ("hf", "mg"), "save_model_type": ("mg", "hf"), "ckpt_format": ("torch", "torch_dist")}


def field_help(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of ``cls``'s docstring."""
    text = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    helps: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"^\s{8}(\w+): (.*)$", line)
        if match:
            name, helps[match.group(1)] = match.group(1), match.group(2).strip()
        elif name and line.strip():
            helps[name] += " " + line.strip()
    return helps


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field of dataclass ``cls``.

    Bools are switches (``--no-<name>`` for those on by default); a field without a default is a
    required flag; ``X | None`` fields take an ``X``.
    """
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        options = typing.get_args(hint)
        kind = next((t for t in options if t is not type(None)), hint) if options else hint
        required = field.default is dataclasses.MISSING
        text = helps.get(field.name, "").replace("``", "")
        if kind is bool:
            if field.default is True:  # on by default: the flag turns it off
                parser.add_argument("--no-" + flag[2:], dest=field.name, action="store_false", help=f"do not {text}")
            else:
                parser.add_argument(flag, action="store_true", help=text.replace("%", "%%"))
            continue
        if not required and field.default is not None:
            text += f" (default {field.default})"
        parser.add_argument(flag, type=kind, required=required, default=None if required else field.default,
                            choices=_CHOICES.get(field.name), help=text.replace("%", "%%"))


def add_convert_ckpt(sub: argparse._SubParsersAction) -> None:
    """Add ``convert-ckpt`` to the ``mindspeed-llm`` subcommands."""
    parser = sub.add_parser(
        "convert-ckpt", help="convert checkpoints between Hugging Face and Megatron (any TP/PP/EP/VPP)",
        description="Convert a Hugging Face checkpoint to Megatron shards, back, or between Megatron layouts. "
                    "The whole mapping is planned and checked first; output is written to a temporary "
                    "directory and renamed at the end.")
    add_dataclass_flags(parser, ConvertConfig)
    parser.set_defaults(func=run_convert_ckpt)


def run_convert_ckpt(args: argparse.Namespace) -> int:
    """Run ``convert-ckpt`` from parsed arguments; returns the exit status."""
    names = {f.name for f in dataclasses.fields(ConvertConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    for key in ("load_dir", "save_dir", "hf_cfg_dir", "lora_load"):
        if values.get(key) is not None:
            values[key] = Path(values[key])
    # A ValueError (bad input, nothing written) becomes one line on stderr and exit status 2 (suite_cli).
    report = convert_checkpoint(ConvertConfig(**values))
    sys.stdout.write(report.describe() + "\n")
    return 0


COMMANDS.register("convert-ckpt", add_convert_ckpt)
