"""The shape every suite's command line shares: ``mindspeed-<suite> COMMAND [options]``.

A suite keeps a :class:`~mindspeed.registry.Registry` of commands; each entry is a function
that adds its subparser (and sets ``func``) to the subparsers it is given. Errors that are
the user's (``ValueError``) end with one line on standard error and exit code 2.
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


def run_suite(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; help when none is given."""
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # user errors name the input and the fix
        sys.stderr.write(f"{parser.prog}: error: {err}\n")
        return 2
