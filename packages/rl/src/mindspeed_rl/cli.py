"""``mindspeed-rl``: the RL suite: GRPO and friends on Ray.

Subcommands are registered in :data:`COMMANDS` as they are built; ``mindspeed-rl --help``
lists the ones this version has.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable

from mindspeed.log import setup_logging
from mindspeed.registry import Registry

#: name -> function(subparsers) that adds the subcommand's parser and sets ``func``.
COMMANDS: Registry[Callable[[argparse._SubParsersAction], None]] = Registry("mindspeed-rl command")


def build_parser() -> argparse.ArgumentParser:
    """The ``mindspeed-rl`` argument parser."""
    parser = argparse.ArgumentParser(prog="mindspeed-rl", description="mindspeed RL suite: GRPO and friends on Ray")
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('mindspeed-rl')}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, add_command in COMMANDS.items():
        add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mindspeed-rl`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
