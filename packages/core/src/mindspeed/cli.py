"""``mindspeed``: information about the core, and the embedded-default demo job.

mindspeed info                   accelerator, packages and the kernel chosen for each op
mindspeed features [--json]      every feature: level, flags, default here, what it changes
mindspeed demo [key=value ...]   train a tiny Llama on generated data (CPU by default)
mindspeed auto-settings --config RECIPE --nnodes N --nproc-per-node D --device-memory GIB [--device TFLOPS,GBPS]
                                 search layouts and memory settings; print the best, write the best recipe

``--verbose`` (anywhere on the line) shows the detail on the console, as in the suites' commands.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys

from mindspeed.config import load_config, to_dict
from mindspeed.log import setup_logging
from mindspeed.suite_cli import add_verbose_flag, apply_verbose, parse_suite_args


def _info(args: argparse.Namespace) -> int:
    # Lazy: keeps torch out of the start-up of mindspeed.cli.
    import torch

    from mindspeed.device import available_accelerators, get_accelerator
    from mindspeed.ops import OPS, available_kernels, list_kernels

    accelerator = get_accelerator()
    packages = {}
    for dist in (
        "mindspeed-core",
        "mindspeed-llm",
        "mindspeed-mm",
        "mindspeed-rl",
        "megatron-core",
        "transformers",
        "ray",
    ):
        try:
            packages[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            packages[dist] = None
    ops = {}
    for op in OPS.keys():
        usable = [k.name for k in available_kernels(op, accelerator.name)]
        ops[op] = {
            "auto": usable[0],
            "available": usable,
            "registered": [k.name for k in list_kernels(op)],
            "doc": OPS.get(op).doc,
        }
    info = {
        "torch": torch.__version__,
        "accelerator": accelerator.describe(),
        "available_accelerators": available_accelerators(),
        "packages": packages,
        "ops": ops,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"mindspeed-core {packages['mindspeed-core']}  torch {torch.__version__}")
    print(
        f"accelerator: {accelerator.name} ({accelerator.dist_backend}), available: {', '.join(info['available_accelerators'])}"
    )
    print("packages: " + ", ".join(f"{k} {v or '-'}" for k, v in packages.items()))
    print(f"{'op':<24}{'auto':<14}{'available':<36}registered")
    for op, row in ops.items():
        print(f"{op:<24}{row['auto']:<14}{','.join(row['available']):<36}{','.join(row['registered'])}")
    return 0


def _features(args: argparse.Namespace) -> int:
    # Lazy: keeps torch out of the start-up of mindspeed.cli.
    import logging

    from mindspeed.features import FEATURES, BuildContext, FeaturesConfig, apply_features

    # The listing is the output: keep the per-change log lines of the dry run off stderr.
    quiet = [logging.getLogger(name) for name in ("mindspeed.features", "mindspeed.ops")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        ctx = BuildContext()  # this machine's accelerator, model facts unknown
        report = apply_features(FeaturesConfig(optimization_level=args.optimization_level), ctx)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    rows = []
    for name, feature in FEATURES.items():
        status = report.status(name)
        changes = report.changes_of(name)
        rows.append(
            {
                **feature.info(),
                "enabled_by_default": status.enabled,
                "why": status.why,
                "changes": [c.to_dict() for c in changes],
            }
        )
    if args.json:
        print(
            json.dumps(
                {"optimization_level": args.optimization_level, "accelerator": ctx.accelerator, "features": rows},
                indent=2,
            )
        )
        return 0
    print(f"features at --optimization-level {args.optimization_level} on {ctx.accelerator} (model facts unknown)")
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        if row["enabled_by_default"]:
            changes = "sets " + (", ".join(f"{c['target']}={c['after']}" for c in row["changes"]) or "nothing here")
        else:
            changes = "would change " + (", ".join(row["targets"]) or "-")
        links = "".join(f"  {key}: {', '.join(row[key])}" for key in ("requires", "conflicts") if row[key])
        print(
            f"{row['name']:<{width}}  level {row['level']}  {'on ' if row['enabled_by_default'] else 'off'}  "
            f"{' '.join(row['flags'])}{links}"
        )
        print(f"{'':<{width}}  {row['description']}; {changes}")
        if not row["enabled_by_default"]:
            print(f"{'':<{width}}  {row['why']}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    # Lazy: keeps torch out of the start-up of mindspeed.cli.
    from mindspeed.demo import DemoConfig, run_demo

    cfg = load_config(DemoConfig, args.config, args.overrides)
    result = run_demo(cfg)
    print(
        json.dumps(
            {
                "config": to_dict(cfg),
                "first_loss": round(result.first_loss, 4),
                "last_loss": round(result.last_loss, 4),
                "noise_floor": round(result.floor, 4),
                "tokens_per_second": round(result.tokens_per_second, 1),
                "peak_memory_mib": round(result.peak_memory_bytes / 2**20, 2),
                "kernels": result.kernels,
            },
            indent=2,
        )
    )
    return 0


def _auto_settings(args: argparse.Namespace) -> int:
    # Lazy: the search imports torch (through mindspeed.metrics); keep it out of the CLI's start-up.
    from mindspeed.autosettings.cli import run_auto_settings

    return run_auto_settings(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed`` argument parser."""
    parser = argparse.ArgumentParser(prog="mindspeed", description="mindspeed acceleration core")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {importlib.metadata.version('mindspeed-core')}"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    add_verbose_flag(parser)  # as the suites' command lines
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="accelerator, packages and the kernel chosen for each op")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_info)
    features = sub.add_parser("features", help="list the features: level, flags, default on this machine, changes")
    features.add_argument(
        "--optimization-level",
        type=int,
        choices=(0, 1, 2),
        default=2,
        help="the level defaults are decided at (default 2)",
    )
    features.add_argument("--json", action="store_true", help="machine-readable output")
    features.set_defaults(func=_features)
    demo = sub.add_parser("demo", help="train a tiny Llama on generated data (the embedded default)")
    demo.add_argument("--config", default=None, help="YAML file of DemoConfig fields")
    demo.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100 impl=reference")
    demo.set_defaults(func=_demo)
    from mindspeed.autosettings.cli import add_arguments

    auto = sub.add_parser(
        "auto-settings",
        help="search TP/PP/VPP/DP/CP/EP, micro batch, recompute and swap settings; write the best recipe",
    )
    add_arguments(auto)
    auto.set_defaults(func=_auto_settings)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed`` command."""
    args = parse_suite_args(build_parser(), argv)  # --verbose and key=value anywhere on the line
    apply_verbose(args)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except ValueError as err:  # user errors (ConfigError included) name the input and the fix
        print(f"mindspeed: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"mindspeed: {args.command} failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
