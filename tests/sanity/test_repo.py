"""The repository keeps its promises: CI runs the README's test command, packages are complete."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"core": "mindspeed", "llm": "mindspeed_llm", "mm": "mindspeed_mm", "rl": "mindspeed_rl"}


def _readme_commands() -> list[str]:
    block = re.search(r"## Two commands\n.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md lost its 'Two commands' bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    test_command = next(c for c in commands if "pytest" in c)
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command.strip() in ci_lines, ".ci/run must run the README's test command verbatim"


def test_every_package_has_version_script_and_readme() -> None:
    for folder, module in PACKAGES.items():
        meta = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
        assert meta["name"] == f"mindspeed-{folder}"
        assert meta["version"]
        script = "mindspeed" if folder == "core" else f"mindspeed-{folder}"
        assert meta["scripts"][script].startswith(f"{module}.cli:")
        assert (ROOT / "packages" / folder / "src" / module / "__init__.py").is_file()
        assert (ROOT / "tests" / folder).is_dir(), f"tests/{folder} must mirror packages/{folder}"


def test_lock_has_no_machine_paths() -> None:
    lock = (ROOT / "uv.lock").read_text()
    assert "file://" not in lock and "/opt/" not in lock and "/root/" not in lock
    assert re.search(r'name = "torch"\nversion = "2\.13\.\d+"', lock)


def test_readme_links_exist() -> None:
    for link in re.findall(r"\]\(((?:docs|examples)/[^)]+)\)", (ROOT / "README.md").read_text()):
        assert (ROOT / link).exists(), f"README links to missing {link}"


def _feature_rows() -> list[list[str]]:
    """The README feature table's rows, split into cells (escaped pipes kept inside a cell)."""
    text = (ROOT / "README.md").read_text()
    table = re.search(r"\| feature \| status \| docs \| code \| test \|\n\| [-| ]+\|\n((?:\|.*\n?)+)", text)
    assert table, "README.md's feature table lost its header 'feature | status | docs | code | test'"
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in table.group(1).splitlines()]


def test_readme_feature_rows_link_existing_docs_code_and_tests() -> None:
    """Every feature names its docs page, the code and the test that proves it, and they exist."""
    rows = _feature_rows()
    assert len(rows) >= 15
    missing = []
    for row in rows:
        assert len(row) == 5, f"a feature row needs 5 cells: {row[0][:60]}"
        for column, cell in zip(("docs", "code", "test"), row[2:]):
            targets = re.findall(r"\]\(([^)#]+)\)", cell)
            assert targets, f"{row[0][:60]}: no link in the {column} column"
            if column == "test":
                assert all(t.startswith("tests/") for t in targets), f"{row[0][:60]}: test links {targets}"
            missing += [f"{row[0][:40]} -> {t}" for t in targets if not (ROOT / t).exists()]
    assert not missing, "README feature table links to paths that do not exist:\n" + "\n".join(missing)


def _readme_block_commands() -> list[list[str]]:
    """The ``mindspeed-*`` commands of the README's bash blocks after "Two commands", as argument lists
    (continuation lines joined, the leading ``uv run --frozen`` dropped)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text.split("## Two commands", 1)[1], re.S)[1:]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words[:1] in (["uv"], ["run"], ["--frozen"]):
                words = words[1:]
            if words and words[0].startswith("mindspeed"):
                commands.append(words)
    return commands


def _recipe_header_commands(recipe: Path) -> list[list[str]]:
    """The commands a recipe's header comment shows (``#   mindspeed-mm ...`` lines, continuations joined)."""
    header = "\n".join(line[1:] for line in recipe.read_text().splitlines() if line.startswith("#"))
    lines = header.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith("mindspeed")]


def test_readme_generation_commands_parse_and_follow_their_recipes() -> None:
    """The README's text-to-image / video commands are the recipes' own: each parses with the CLI's parser,
    and each ``generate`` samples what the ``train`` before it exports (``--load-dir`` is the recipe's
    ``checkpoint.save_hf``), into an ``--output-dir``, exactly as the recipe's header says."""
    import yaml

    from mindspeed_mm.cli import build_parser

    commands = [c for c in _readme_block_commands() if c[0] == "mindspeed-mm"]
    verbs = [c[1] for c in commands]
    assert verbs == ["train", "generate", "train", "generate"], commands
    parser = build_parser()
    for train, generate in zip(commands[::2], commands[1::2], strict=True):
        for command in (train, generate):
            try:
                parser.parse_args(command[1:])
            except SystemExit as error:  # argparse printed which argument
                raise AssertionError(f"README: {shlex.join(command)} does not parse (exit {error.code})") from None
        args = parser.parse_args(generate[1:])
        recipe = ROOT / parser.parse_args(train[1:]).config
        checkpoint = yaml.safe_load(recipe.read_text())["checkpoint"]
        assert args.load_dir == checkpoint["save_hf"], (recipe.name, args.load_dir)
        assert args.pipeline_dir == args.prompts_file and args.prompts_file.startswith("demo-"), generate
        assert args.output_dir.startswith(checkpoint["save"] + "/"), generate
        assert _recipe_header_commands(recipe) == [train, generate], f"{recipe.name}'s header shows other commands"
