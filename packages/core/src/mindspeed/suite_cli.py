"""The shape every suite's command line shares: ``mindspeed-<suite> COMMAND [options]``.

A suite's ``cli.py`` holds a literal table of its commands: name -> a function that adds the
subparser (and sets ``func``) to the subparsers it is given. The subcommand modules define those
functions and never import the suite's ``cli.py``. Flags derived from a dataclass config take
their help text from its docstring (:func:`field_help`, :func:`add_dataclass_flags`). A command
with an ``overrides`` positional (``key=value ...``) takes them anywhere on the line, between and
after its options too; so is ``--verbose`` (the console shows the detail the run's report file
keeps). Errors that are the user's (``ValueError``) end with one line on standard error and exit
code 2; a save that ran out of space (:class:`~mindspeed.checkpointing.DiskFullError`) with one line
and exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence

from mindspeed.checkpointing.disk_full import DiskFullError
from mindspeed.log import VERBOSE_ENV, setup_logging
from mindspeed.nodes import PeerLost, RankFailure

#: What a suite registers: a function that adds one subcommand to the subparsers.
AddCommand = Callable[[argparse._SubParsersAction], None]

#: The output directory of a converter is ``--save-dir`` (Megatron's and MindSpeed's pair to ``--load-dir``)
#: and, as every other output directory of the project, ``--output-dir`` (Hugging Face's ``output_dir``).
OUTPUT_DIR_ALIASES: Mapping[str, Sequence[str]] = {"save_dir": ("--output-dir",)}


def build_suite_parser(prog: str, description: str, commands: Mapping[str, AddCommand]) -> argparse.ArgumentParser:
    """The parser of ``prog`` with ``--version``, ``--log-level`` and every command of ``commands``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version(prog)}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    add_verbose_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, add_command in commands.items():
        add_command(sub)
    return parser


_VERBOSE = ("--verbose", "-v")


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` / ``-v``: every command line of the project shares its meaning (see :func:`apply_verbose`)."""
    parser.add_argument(
        *_VERBOSE,
        action="store_true",
        help="also show the detail on the console: the adaptor's patches, the features table, kernel "
        "choices and other libraries' warnings (always in the run's report.txt); anywhere on "
        "the line",
    )


def apply_verbose(args: argparse.Namespace) -> None:
    """Make ``--verbose`` hold for this process and the ranks it spawns (before :func:`setup_logging`)."""
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # spawned ranks inherit it


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
    if any(arg in _VERBOSE for arg in extras):  # --verbose after the command
        args.verbose = True
        extras = [arg for arg in extras if arg not in _VERBOSE]
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
    apply_verbose(args)
    setup_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # user errors name the input and the fix
        sys.stderr.write(f"{parser.prog}: error: {err}\n")
        return 2
    except DiskFullError as err:  # a save that ran out of space: one line, exit 1 (docs/reliability.md)
        # Raised in a Ray worker it arrives as a RayTaskError that is also a DiskFullError: its cause is the line.
        cause = getattr(err, "cause", None)
        sys.stderr.write(f"{parser.prog}: error: {cause if isinstance(cause, DiskFullError) else err}\n")
        return 1
    except PeerLost as err:  # another node died mid-run: one line, exit 1 (docs/scale-out.md)
        sys.stderr.write(f"{parser.prog}: error: {err}\n")
        return 1
    except RankFailure as err:  # a spawned rank failed (after --max-restarts): one line, then its traceback if any
        line, _, details = str(err).partition("\n")
        sys.stderr.write(
            f"{parser.prog}: error: {line}; the same command resumes from the newest complete checkpoint\n"
            + (f"{details}\n" if details else "")
        )
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves and returns 130 itself)
        sys.stderr.write(f"{parser.prog}: interrupted\n")
        return 130


_ATTRIBUTE = re.compile(r"^\s{8}(\w+): (.*)$")


def field_help(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of ``cls``'s (Google-style) docstring.

    An attribute's continuation lines are joined to it; ``%`` is doubled, so the text is ready
    for an argparse ``help=``.
    """
    text = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    helps: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        match = _ATTRIBUTE.match(line)
        if match:
            name, helps[match.group(1)] = match.group(1), match.group(2).strip()
        elif name and line.strip():
            helps[name] += " " + line.strip()
    return {key: value.replace("%", "%%") for key, value in helps.items()}


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    choices: Mapping[str, Sequence[str]] | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """One ``--flag`` per field of dataclass ``cls`` (``load_dir`` -> ``--load-dir``), help from its docstring.

    Bools are switches (``--no-<name>`` for those on by default: its help is "do not <the field's
    text>", or the text itself where it names ``--no-<name>``); a field without a default is a
    required flag; ``X | None`` fields take an ``X``.

    Args:
        parser: the (sub)parser to add to.
        cls: the config dataclass.
        choices: field name -> its allowed values.
        aliases: field name -> more spellings of its flag, shown in the help after the first
            (``{"save_dir": ["--output-dir"]}``: the project's name for an output directory).
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
                off = "--no-" + flag[2:]
                # A docstring that names the switch says what it does; else it says what is done without it.
                help_text = text if off in text else f"do not {text}"
                parser.add_argument(off, dest=field.name, action="store_false", help=help_text)
            else:
                parser.add_argument(flag, action="store_true", help=text)
            continue
        if not required and field.default not in (None, ""):  # no "(default )"
            text += f" (default {str(field.default).replace('%', '%%')})"
        parser.add_argument(
            flag,
            *(aliases or {}).get(field.name, ()),
            type=kind,
            required=required,
            default=None if required else field.default,
            choices=(choices or {}).get(field.name),
            help=text,
        )


class _RenamedFlag(argparse.Action):
    """An old spelling of a flag: sets the new flag's value and writes one deprecation line on standard error."""

    def __init__(self, option_strings: list[str], dest: str, new_flag: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: D102 -- argparse's
        sys.stderr.write(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new_flag}\n")
        setattr(namespace, self.dest, values)


def add_renamed_flag(parser: argparse._ActionsContainer, old: str, new: str) -> None:
    """Accept ``old`` (e.g. ``--hf-cfg-dir``) as a deprecated spelling of the flag ``new`` (``--base-dir``).

    The value lands where ``new``'s does; using ``old`` writes one deprecation line on standard
    error. ``old`` is left out of the help. For a required ``new``, add both to a required
    mutually exclusive group and pass the group as ``parser``.
    """
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(
        old, dest=dest, action=_RenamedFlag, new_flag=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
