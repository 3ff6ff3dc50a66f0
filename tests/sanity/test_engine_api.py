"""mindspeed_rl uses the LLM suite through its engine API only (``mindspeed_llm.engine``).

Read from the source with ``ast`` (nothing is imported): every ``import`` of every module under
``packages/rl`` (inside functions and ``TYPE_CHECKING`` blocks too) and every string that names
a module the way ``importlib`` takes it may name ``mindspeed_llm.engine`` and nothing else of
the LLM suite. The engine module documents every name of its ``__all__`` in its docstring, and
each resolves.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "mindspeed_llm.engine"
#: A string that is a dotted module path of the LLM suite (``importlib.import_module`` style).
MODULE_STRING = re.compile(r"mindspeed_llm(\.\w+)*")


def llm_uses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, module)`` for every use of the LLM suite in ``source`` other than its engine API."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] if node.module != "mindspeed_llm" else [f"mindspeed_llm.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.fullmatch(node.value):
            names = [node.value]
        for name in names:
            if (name == "mindspeed_llm" or name.startswith("mindspeed_llm.")) and name != ENGINE:
                found.append((node.lineno, name))
    return sorted(found)


def test_rl_imports_only_the_llm_engine_api() -> None:
    files = sorted((ROOT / "packages" / "rl").rglob("*.py"))
    assert len(files) > 30, "the scan must cover the rl package"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} uses {name}"
        for path in files
        for line, name in llm_uses(path.read_text(), str(path))
    ]
    assert not wrong, (
        f"mindspeed_rl may use the LLM suite only through {ENGINE} (add the name there, documented):\n"
        + "\n".join(wrong)
    )


def test_the_scan_finds_internal_imports() -> None:
    planted = (
        "from mindspeed_llm.engine import build_engine\n"
        "import mindspeed_llm.engine\n"
        "from mindspeed_llm.training.model import unwrap\n"
        "def f():\n    import mindspeed_llm.inference\n"
        "from mindspeed_llm import training\n"
        "importlib.import_module('mindspeed_llm.training.trainer')\n"
        "DOC = ':class:`~mindspeed_llm.inference.InferenceEngine`'\n"
    )
    assert llm_uses(planted) == [
        (3, "mindspeed_llm.training.model"),
        (5, "mindspeed_llm.inference"),
        (6, "mindspeed_llm.training"),
        (7, "mindspeed_llm.training.trainer"),
    ]


def test_engine_api_is_documented_and_resolves() -> None:
    engine = importlib.import_module(ENGINE)
    names = list(engine.__all__)
    assert len(names) == len(set(names))
    undocumented = [name for name in names if f"`{name}`" not in (engine.__doc__ or "")]
    assert not undocumented, f"{ENGINE}'s docstring does not list {undocumented}"
    missing = [name for name in names if getattr(engine, name, None) is None]
    assert not missing, missing
    public = {name for name in vars(engine) if not name.startswith("_") and name != "annotations"}
    assert public == set(names), f"names of {ENGINE} outside __all__: {sorted(public - set(names))}"
