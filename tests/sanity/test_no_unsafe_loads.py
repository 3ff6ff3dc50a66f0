"""Library code loads nothing that can run code: no pickle.load, no yaml.load, no weights_only=False, no remote code.

Every ``torch.load`` in ``packages/`` passes ``weights_only=True`` explicitly (the default can be
flipped by ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``). Checkpoint files are read through
``mindspeed.checkpointing.trust`` (docs/reliability.md, "Trust").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The pattern the pre-commit hook greps for.
UNSAFE = re.compile(r"weights_only *= *False|pickle\.loads?\(|yaml\.load\(|trust_remote_code *= *True")


def _sources() -> list[Path]:
    return sorted(ROOT.glob("packages/*/src/**/*.py"))


def _torch_loads_without_weights_only(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                lines.append(node.lineno)
    return lines


def test_no_code_loading_calls() -> None:
    found = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if UNSAFE.search(line)]
        found += [
            f"{rel}:{n}: torch.load without weights_only=True"
            for n in _torch_loads_without_weights_only(ast.parse(text))
        ]
    assert _sources() and not found, "\n".join(found)


def test_the_check_finds_what_it_looks_for() -> None:
    bad = (
        "import torch\nx = torch.load(p)\ny = torch.load(p, weights_only=False)\nz = torch.load(p, weights_only=True)\n"
    )
    assert _torch_loads_without_weights_only(ast.parse(bad)) == [2, 3]
    assert all(
        UNSAFE.search(s) for s in ("pickle.load(f)", "yaml.load(s)", "trust_remote_code=True", "weights_only = False")
    )
