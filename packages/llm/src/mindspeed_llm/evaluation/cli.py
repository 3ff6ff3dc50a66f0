"""The ``mindspeed-llm evaluate`` subcommand, with MindSpeed-LLM's flag names where it has them.

Every flag is a field of :class:`EvaluateConfig` (help text from its docstring). The results go
to standard output as a table and, with ``--output``, to a JSON file. Bad input (a missing file,
a malformed record, an unknown task) ends with one line on standard error and exit status 2,
before a model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mindspeed.metrics.report import format_table
from mindspeed.suite_cli import field_help
from mindspeed_llm.evaluation import gsm8k, mmlu, perplexity  # noqa: F401  (register the tasks)
from mindspeed_llm.evaluation.harness import require_lm_eval
from mindspeed_llm.evaluation.runner import BACKENDS, DTYPES, EvaluateConfig, evaluate
from mindspeed_llm.evaluation.tasks import TASKS

_FIELDS = {f.name: f for f in dataclasses.fields(EvaluateConfig)}


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    """Add ``evaluate`` to the ``mindspeed-llm`` subcommands."""
    helps = field_help(EvaluateConfig)
    parser = sub.add_parser(
        "evaluate",
        help="score a model on MMLU, GSM8K and perplexity from local data files",
        description="Evaluate a Hugging Face or Megatron checkpoint on local data in the public formats: MMLU "
        "(multiple choice by log-likelihood), GSM8K (greedy generation, final number) and perplexity. "
        "Prints a table; --output writes JSON. '--task-data-path demo' uses the tiny shipped samples.",
    )

    def flag(name: str, extra: str = "", aliases: tuple[str, ...] = (), **kwargs) -> None:
        default = _FIELDS[name].default
        text = helps.get(name, "") + extra
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        elif kwargs.get("action") != "store_true":
            kwargs["default"] = default
            if default is not None:
                text += f" (default {default})"
        parser.add_argument("--" + name.replace("_", "-"), *aliases, dest=name, help=text, **kwargs)

    known = ", ".join(map(str, TASKS.keys()))
    flag("load_dir", metavar="DIR")
    flag(
        "task",
        action="extend",
        nargs="+",
        metavar="NAME",
        aliases=("--tasks",),  # lm-eval's name
        extra=f" Repeatable or comma separated; known: {known} (with --harness: lm-eval tasks).",
    )
    flag("task_data_path", action="extend", nargs="+", metavar="PATH")
    flag("hf_cfg_dir", metavar="DIR")
    flag("tokenizer_name_or_path", metavar="DIR")
    flag("backend", choices=BACKENDS)
    flag("shots", metavar="N|TASK=N")
    flag("max_new_tokens", type=int, metavar="N")
    flag("evaluation_batch_size", type=int, metavar="N")
    # MindSpeed-LLM's name and lm-eval's
    flag("max_samples", type=int, metavar="N", aliases=("--max-eval-samples", "--limit"))
    flag("max_seq_len", type=int, metavar="N")
    flag("ppl_stride", type=int, metavar="N")
    flag("dtype", choices=DTYPES)
    flag("output", metavar="FILE")
    flag("log_samples", action="store_true")
    flag("harness", action="store_true")
    flag("include_path", action="extend", nargs="+", metavar="DIR")
    flag("num_fewshot", type=int, metavar="N")
    flag("output_dir", metavar="DIR")
    flag("apply_chat_template", action="store_true")
    flag("fewshot_as_multiturn", action="store_true")
    parser.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    """Run ``evaluate`` from parsed arguments; returns the exit status."""
    config = EvaluateConfig(**{name: getattr(args, name) for name in _FIELDS})
    # A ValueError (bad input) becomes one line on stderr and exit status 2 (suite_cli).
    if config.harness:
        results = run_harness(config)
    else:
        results, _ = evaluate(config)
    sys.stdout.write(format_table(results) + "\n")
    for written in (config.output, config.output_dir):
        if written:
            sys.stdout.write(f"wrote {written}\n")
    return 0


def run_harness(config: EvaluateConfig) -> list:
    """``--harness``: lm-eval's ``simple_evaluate`` with the ``mindspeed`` model (needs the eval extra)."""
    require_lm_eval()
    from mindspeed_llm.evaluation.harness.run import evaluate_harness  # lm-eval is optional: imported here only

    results, _, _ = evaluate_harness(config)
    return results
