"""The shape every suite's command line shares: ``mindspeed-<suite> COMMAND [options]``.

A suite keeps a :class:`~mindspeed.registry.Registry` of commands; each entry is a function
that adds its subparser (and sets ``func``) to the subparsers it is given. A command with an
``overrides`` positional (``key=value ...``) takes them anywhere on the line, between and after
its options too. Errors that are the user's (``ValueError``) end with one line on standard error
and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable

from mindspeed.log import setup_logging
from mindspeed.registry import Registry

#: What a suite registers: a function that adds one subcommand to the subparsers.
AddCommand = Callable[[argparse._SubParsersAction], None]


def build_suite_parser(prog: str, description: str, commands: Registry[AddCommand]) -> argparse.ArgumentParser:
    """The parser of ``prog`` with ``--version``, ``--log-level`` and every registered command."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version(prog)}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, add_command in commands.items():
        add_command(sub)
    return parser


def is_override(arg: str) -> bool:
    """``key=value`` (not an option): what a command's ``overrides`` positional collects."""
    return not arg.startswith("-") and "=" in arg


def parse_suite_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` that also accepts ``key=value`` overrides after later options.

    argparse fills a ``nargs="*"`` positional from its first run of values only, so in
    ``--config X a=1 --nproc-per-node 2 b=2`` it would reject ``b=2``. The overrides left over
    are appended, in order, to the command's ``overrides``; anything else left over is the
    usual "unrecognized arguments" error (exit 2).
    """
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or not all(map(is_override, extras)):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*(args.overrides or []), *extras]
    return args


def run_suite(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; help when none is given."""
    args = parse_suite_args(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # user errors name the input and the fix
        sys.stderr.write(f"{parser.prog}: error: {err}\n")
        return 2
