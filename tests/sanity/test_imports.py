"""The import graph of the project's own modules: no cycles, dependencies only down the layers.

Read from the source with ``ast`` (nothing is imported). Every ``import`` counts, those inside
functions too (a lazy import hides a dependency, it does not remove it); only imports under
``if TYPE_CHECKING:`` are left out. ``from a.b import c`` depends on the module ``a.b.c`` when
there is one, else on ``a.b`` (its ``__init__.py`` for a package), and on the packages it runs
first (``a``, ``a.b``) unless the importing module is inside them (its own packages are being
imported already; counting them would make every re-exporting ``__init__`` a cycle).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The layers: each top package and the packages of ours it may import (docs/design: the suites
#: stand on the core; RL trains the LLM suite's models and the MM suite's vision-language models). mm may not import llm: `pip install
#: mindspeed-mm` must not pull in the LLM suite (its pyproject is checked below as well).
ALLOWED = {
    "mindspeed": set(),
    "mindspeed_llm": {"mindspeed"},
    "mindspeed_mm": {"mindspeed"},
    "mindspeed_rl": {"mindspeed", "mindspeed_llm", "mindspeed_mm"},
}
#: The distribution of each top package (the name its pyproject declares).
DISTRIBUTIONS = {
    "mindspeed": ("core", "mindspeed-core"),
    "mindspeed_llm": ("llm", "mindspeed-llm"),
    "mindspeed_mm": ("mm", "mindspeed-mm"),
    "mindspeed_rl": ("rl", "mindspeed-rl"),
}


def module_files() -> dict[str, Path]:
    """Every module of ours by dotted name (``mindspeed.features`` for its ``__init__.py``)."""
    files = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules of ours that ``name`` imports, each with the line of its first import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for target in targets:
            while target and target not in modules:  # "import a.b.c" of a name inside a module
                target = target.rpartition(".")[0]
            # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless this module is inside them.
            parts = target.split(".")
            for loaded in [".".join(parts[:i]) for i in range(1, len(parts))] + [target]:
                if loaded in modules and loaded != name and not name.startswith(loaded + "."):
                    found[loaded] = min(found.get(loaded, node.lineno), node.lineno)
    return found


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}, modules


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    members = set(component)
    edges = [
        f"  {a} -> {b} ({modules[a].relative_to(ROOT)}:{line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return "\n".join([" <-> ".join(component), *edges])


def test_no_import_cycles() -> None:
    graph, modules = import_graph()
    assert len(graph) > 150, "the graph must cover the packages"
    found = cycles(graph)
    assert not found, "import cycles (break them: move the shared part down, or pass it as a value):\n" + "\n".join(
        _describe(c, graph, modules) for c in found
    )


def test_imports_follow_the_layers() -> None:
    graph, modules = import_graph()
    wrong = [
        f"{modules[a].relative_to(ROOT)}:{line} imports {b}"
        for a, targets in sorted(graph.items())
        for b, line in sorted(targets.items())
        if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]
    ]
    assert not wrong, (
        "imports against the layering (core -> nothing of ours; llm -> core; mm -> core; "
        "rl -> core, llm, mm):\n" + "\n".join(wrong)
    )


def declared_suites(folder: str) -> set[str]:
    """The distributions of ours that ``packages/<folder>/pyproject.toml`` depends on (extras included)."""
    project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    ours = {name for _, name in DISTRIBUTIONS.values()}
    return {name for req in requirements if (name := re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0]) in ours}


def test_pyprojects_depend_on_exactly_the_layers_below() -> None:
    """What a wheel installs follows the same layers: mindspeed-mm's dependencies name no mindspeed-llm."""
    for top, (folder, _) in DISTRIBUTIONS.items():
        expected = {DISTRIBUTIONS[lower][1] for lower in ALLOWED[top]}
        assert declared_suites(folder) == expected, (
            f"packages/{folder}/pyproject.toml depends on {sorted(declared_suites(folder))}, "
            f"the layers allow {sorted(expected)}"
        )


def test_the_checker_sees_cycles_and_relative_imports(tmp_path) -> None:
    """The checker itself: a planted two-module loop through a relative import is found."""
    graph = {"p.a": {"p.b": 1}, "p.b": {"p.a": 3}, "p.c": {"p.a": 1}}
    assert cycles(graph) == [["p.a", "p.b"]]
    (tmp_path / "b.py").write_text("from . import a\nfrom .a import thing\n")
    modules = {"p": tmp_path / "__init__.py", "p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    assert imports_of("p.b", tmp_path / "b.py", modules) == {"p.a": 1}
    (tmp_path / "c.py").write_text("def f():\n    import p.a.x\nif TYPE_CHECKING:\n    import p.b\n")
    assert imports_of("p.c", tmp_path / "c.py", modules) == {"p.a": 2}
    # from outside the package, its __init__ runs first: q.d -> p -> ... is an edge to p too
    modules["q.d"] = tmp_path / "d.py"
    (tmp_path / "d.py").write_text("from p.a import thing\n")
    assert imports_of("q.d", tmp_path / "d.py", modules) == {"p": 1, "p.a": 1}
