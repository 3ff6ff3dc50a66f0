"""Every command line's help reads cleanly: each flag of ``mindspeed``, ``mindspeed-llm``, ``mindspeed-mm`` and
``mindspeed-rl`` (every subcommand) has a help text without the marks of a text assembled wrongly."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from mindspeed.cli import build_parser as core_parser
from mindspeed_llm.cli import build_parser as llm_parser
from mindspeed_mm.cli import build_parser as mm_parser
from mindspeed_rl.cli import build_parser as rl_parser

PARSERS = {"mindspeed": core_parser, "mindspeed-llm": llm_parser, "mindspeed-mm": mm_parser, "mindspeed-rl": rl_parser}


def walk(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, argparse.Action]]:
    """Every (parser, action) of ``parser`` and its subcommands, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)
        else:
            yield parser, action


def rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as ``--help`` shows it (``%(default)s`` and friends expanded, ``%%`` undoubled)."""
    return parser._get_formatter()._expand_help(action)


def _unbalanced_quotes(text: str) -> bool:
    rest = re.sub(r"(?<=\w)'(?=\w)", "", text)  # the model's
    rest = re.sub(r"(?<!\w)'[^']+'(?!\w)", "", rest)  # 'quoted'
    rest = re.sub(r"(?<=s)'(?=\s)", "", rest)  # the models' own
    return text.count('"') % 2 == 1 or "'" in rest


def garbling(text: str) -> list[str]:
    """What is wrong with one help text (empty: nothing)."""
    problems = []
    if not text.strip():
        problems.append("empty")
    if text.count("(") != text.count(")") or text.count("[") != text.count("]"):
        problems.append("unbalanced brackets")
    if _unbalanced_quotes(text):
        problems.append("unbalanced quotes")
    if re.search(r"%[%(sdfr]", text):
        problems.append("a % formatting artefact")
    if "  " in text or text != text.strip():
        problems.append("double or stray spaces")
    if "``" in text or "==SUPPRESS==" in text:
        problems.append("markup left in")
    if re.search(r"\bdo not (a|an|the|its|with)\b", text, re.I):
        problems.append("'do not' before a noun: a switch's help glued to a description")
    if re.search(r"\(default (None|)\)", text):
        problems.append("an empty default")
    return problems


def test_the_garbling_check_catches_what_it_claims() -> None:
    for text in (
        "",
        "do not a checkpoint of a run gives its weights",
        "demo-t2v / demo-t2i for the demos').",
        "the rate (default 5",
        "100%% of it",
        "two  spaces",
        "``key``",
        "a size (default None)",
    ):
        assert garbling(text), text
    assert not garbling("the model's weights (the models' own); 'demo' for the demo (default 5%)")


@pytest.mark.parametrize("prog", list(PARSERS))
def test_every_help_text_reads_cleanly(prog: str) -> None:
    root = PARSERS[prog]()
    bad = []
    for parser, action in walk(root):
        if action.help == argparse.SUPPRESS:  # a hidden, renamed spelling
            continue
        text = rendered_help(parser, action)
        bad += [
            f"{parser.prog} {'/'.join(action.option_strings) or action.dest}: {p}: {text!r}" for p in garbling(text)
        ]
    for parser in {id(p): p for p, _ in walk(root)}.values():
        parser.format_help()  # renders (argparse raises on a bad %-format)
        for text in (parser.description or "",):
            bad += [f"{parser.prog} description: {p}: {text!r}" for p in garbling(text) if p != "empty"]
    assert not bad, "\n".join(bad)


def test_output_flags_follow_one_rule(capsys) -> None:
    """An output directory is ``--output-dir`` (Hugging Face's ``output_dir``) on every command line; the
    converters show Megatron's ``--save-dir`` (the pair of ``--load-dir``) first. An output file is ``--output``
    (``preprocess-data --output-prefix`` is Megatron's prefix). Earlier spellings parse, hidden, with a note."""
    odd = {"--out", "--out-dir", "--output-path", "--output-file", "--save-path", "--save", "--outdir"}
    shown = []
    for build in PARSERS.values():
        for parser, action in walk(build()):
            if action.help == argparse.SUPPRESS:
                continue
            options = set(action.option_strings)
            shown += [f"{parser.prog} {option}" for option in sorted(options & odd)]
            if "--save-dir" in options:
                assert "--output-dir" in options, parser.prog
    assert not shown, shown
    convert_ckpt = ["convert-ckpt", "--load-dir", "a", "--output-dir", "b"]
    assert str(llm_parser().parse_args(convert_ckpt).save_dir) == "b"
    convert = ["convert", "--load-format", "hf", "--save-format", "dcp", "--load-dir", "a", "--output-dir", "b"]
    assert str(mm_parser().parse_args(convert).save_dir) == "b"
    assert rl_parser().parse_args(["make-demo-model", "--output-dir", "d"]).output_dir == "d"
    assert rl_parser().parse_args(["make-demo-model", "--out", "d"]).output_dir == "d"  # the earlier spelling
    assert capsys.readouterr().err == "mindspeed-rl make-demo-model: warning: --out is deprecated; use --output-dir\n"
