"""The ``mindspeed-llm preprocess-data`` subcommand, with MindSpeed-LLM's flag names.

Every flag is a field of :class:`PreprocessConfig` (help text from its docstring, default from
the field), so the CLI and the Python API cannot drift apart. ``--tokenizer-type
PretrainedFromHF`` is accepted so MindSpeed-LLM scripts run unchanged. User errors (bad flags,
unreadable input, a malformed record) end with one line on standard error and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from mindspeed.suite_cli import field_help
from mindspeed_llm.data.handlers import HANDLERS
from mindspeed_llm.data.preprocess import PreprocessConfig, preprocess_data
from mindspeed_llm.data.readers import describe_json_error
from mindspeed_llm.data.templates import PROMPT_TYPES

_FIELDS = {f.name: f for f in dataclasses.fields(PreprocessConfig)}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({describe_json_error(err)}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def add_preprocess_data(sub: argparse._SubParsersAction) -> None:
    """Add ``preprocess-data`` to the ``mindspeed-llm`` subcommands."""
    helps = field_help(PreprocessConfig)
    parser = sub.add_parser(
        "preprocess-data",
        help="tokenize raw data into Megatron indexed datasets (pretraining, instruction, pairwise)",
        description="Tokenize jsonl/json/parquet/arrow/csv/txt records with a local tokenizer (or 'demo') and write "
        "Megatron indexed datasets (.bin/.idx). Output is written under temporary names and renamed at the end.",
    )

    def flag(name: str, choices_text: str = "", **kwargs) -> None:
        default = _FIELDS[name].default
        text = helps.get(name, "") + choices_text
        if default not in (dataclasses.MISSING, None, False):
            text += f" (default {default})"
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        elif kwargs.get("action") != "store_true":
            kwargs["default"] = default
        parser.add_argument("--" + name.replace("_", "-"), dest=name, help=text, **kwargs)

    flag("input")
    flag("tokenizer_name_or_path")
    flag("output_prefix")
    flag("handler_name", metavar="NAME", choices_text=f" One of: {', '.join(map(str, HANDLERS))}.")
    flag("json_keys", nargs="+", metavar="KEY")
    flag("append_eod", action="store_true")
    flag("seq_length", type=int)
    flag("pack", action="store_true")
    flag("prompt_type", metavar="NAME", choices_text=f" One of: {', '.join(map(str, PROMPT_TYPES))}.")
    flag("map_keys", type=_json_object, metavar="JSON")
    flag("workers", type=int)
    flag("max_samples", type=int)
    flag("skip_bad_records", action="store_true")
    flag("log_interval", type=int)
    parser.add_argument(
        "--tokenizer-type",
        choices=["PretrainedFromHF"],
        default="PretrainedFromHF",
        help="accepted for MindSpeed-LLM scripts; tokenizers are always loaded with AutoTokenizer",
    )
    parser.set_defaults(func=run_preprocess_data)


def run_preprocess_data(args: argparse.Namespace) -> int:
    """Run ``preprocess-data`` from parsed arguments; returns the exit status."""
    config = PreprocessConfig(**{name: getattr(args, name) for name in _FIELDS})
    # A ValueError (bad input, nothing written) becomes one line on stderr and exit status 2 (suite_cli).
    report = preprocess_data(config)
    sys.stdout.write(report.describe() + "\n")
    return 0
