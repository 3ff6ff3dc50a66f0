"""``mindspeed-mm evaluate``: VQA accuracy of a vision-language model on local files.

Every flag is a field of :class:`mindspeed_mm.evaluation.runner.EvaluateConfig` (help from its
docstring). The results go to standard output as the LLM suite's table and, with ``--output``, to
a JSON file. Bad input (a missing file, a malformed row, a bad flag) ends with one line on standard
error and exit status 2, before the model is loaded.
"""

from __future__ import annotations

import argparse
import sys

from mindspeed.suite_cli import add_renamed_flag, field_help
from mindspeed_mm.evaluation.config import CHOICE_PROMPTS, CHOICE_SCORING, EvaluateConfig


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    """Add ``evaluate`` to the ``mindspeed-mm`` subcommands."""
    parser = sub.add_parser(
        "evaluate",
        help="VQA accuracy (multiple choice and short answer) on MMBench-style TSV or JSON files",
        description="Score a Hugging Face directory or a training checkpoint on local VQA files: MMBench-style TSV "
        "(index, question, hint, A-D, answer, base64 image, category) or JSON/JSONL with image and video paths. "
        "Multiple choice by answer likelihood (or generation and answer extraction), short answers by "
        "normalized exact match. '--task-data-path demo' is the demo's held-out set.",
    )
    helps = field_help(EvaluateConfig)
    text = {name: value.replace("``", "") for name, value in helps.items()}
    parser.add_argument("--load-dir", required=True, metavar="DIR", help=text["load_dir"])
    parser.add_argument(
        "--task-data-path", action="extend", nargs="+", default=[], metavar="PATH", help=text["task_data_path"]
    )
    parser.add_argument("--base-dir", metavar="DIR", help=text["base_dir"])
    add_renamed_flag(parser, "--hf-cfg-dir", "--base-dir")  # its earlier name (mindspeed-llm's)
    parser.add_argument(
        "--choice-scoring",
        default="likelihood",
        choices=CHOICE_SCORING,
        help=text["choice_scoring"] + " (default likelihood)",
    )
    parser.add_argument(
        "--choice-prompt", default="letter", choices=CHOICE_PROMPTS, help=text["choice_prompt"] + " (default letter)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="N", help=text["max_new_tokens"] + " (default 16)"
    )
    parser.add_argument(
        "--evaluation-batch-size", type=int, default=8, metavar="N", help=text["evaluation_batch_size"] + " (default 8)"
    )
    parser.add_argument(
        "--max-samples", "--max-eval-samples", dest="max_samples", type=int, metavar="N", help=text["max_samples"]
    )
    parser.add_argument("--image-dir", metavar="DIR", help=text["image_dir"])
    parser.add_argument(
        "--image-min-pixels", type=int, default=3136, metavar="N", help=text["image_min_pixels"] + " (default 3136)"
    )
    parser.add_argument(
        "--image-max-pixels", type=int, default=262144, metavar="N", help=text["image_max_pixels"] + " (default 262144)"
    )
    parser.add_argument("--video-fps", type=float, default=2.0, metavar="F", help=text["video_fps"] + " (default 2.0)")
    parser.add_argument(
        "--video-maxlen", type=int, default=128, metavar="N", help=text["video_maxlen"] + " (default 128)"
    )
    parser.add_argument(
        "--video-max-pixels", type=int, default=65536, metavar="N", help=text["video_max_pixels"] + " (default 65536)"
    )
    parser.add_argument(
        "--video-min-pixels", type=int, default=256, metavar="N", help=text["video_min_pixels"] + " (default 256)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help=text["dtype"])
    parser.add_argument("--lora-alpha", type=float, metavar="A", help=text["lora_alpha"])
    parser.add_argument("--output", metavar="FILE", help=text["output"])
    parser.add_argument("--log-samples", action="store_true", help=text["log_samples"])
    parser.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    """Run ``evaluate`` from parsed arguments; returns the exit status."""
    # Lazy: keeps torch and transformers out of the start-up of mindspeed_mm.cli.
    from mindspeed.metrics.report import format_table
    from mindspeed_mm.demos.names import resolve_evaluate_demo
    from mindspeed_mm.evaluation.runner import evaluate

    names = EvaluateConfig.__dataclass_fields__
    config = EvaluateConfig(**{name: getattr(args, name) for name in names})
    config.check()  # before a demo name builds the demo's files
    config = resolve_evaluate_demo(config)
    results, _ = evaluate(config)  # a ValueError (bad input) becomes one line on stderr and exit status 2
    sys.stdout.write(format_table(results) + "\n")
    if config.output:
        sys.stdout.write(f"wrote {config.output}\n")
    return 0
