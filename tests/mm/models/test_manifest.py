"""The model manifest: every family by name, its module imported when the name is first looked up.

No module imports a family module for its side effect (``from mindspeed_mm.models import wan  # noqa``):
a lookup through the registries is enough, and importing ``mindspeed_mm.models`` loads no family.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from mindspeed_mm.models.dit import DIT_FAMILIES
from mindspeed_mm.models.family import FAMILIES
from mindspeed_mm.models.manifest import DIT_MODULES, VLM_MODULES, ManifestRegistry

ROOT = Path(__file__).resolve().parents[3]
FAMILY_MODULES = {name.rpartition(".")[2] for name in (*VLM_MODULES.values(), *DIT_MODULES.values())}


def test_every_manifest_entry_is_the_family_its_module_registers() -> None:
    for registry, modules in ((FAMILIES, VLM_MODULES), (DIT_FAMILIES, DIT_MODULES)):
        assert sorted(registry) == sorted(modules)
        for name, module in modules.items():
            family = registry.get(name)
            key = getattr(family, "key", family.architecture)  # DiT variants: ``architecture:variant``
            assert key == name and sys.modules[module] is not None


def test_a_lookup_imports_its_module_once_and_an_unknown_name_lists_all(tmp_path, monkeypatch) -> None:
    (tmp_path / "fam_one.py").write_text("from tests_manifest_registry import REG\nREG.register('One', 1)\n")
    (tmp_path / "fam_two.py").write_text("from tests_manifest_registry import REG\nREG.register('Two', 2)\n")
    (tmp_path / "fam_none.py").write_text("")
    registry = ManifestRegistry("test family", {"One": "fam_one", "Two": "fam_two", "Three": "fam_none"})
    holder = type(sys)("tests_manifest_registry")
    holder.REG = registry
    monkeypatch.setitem(sys.modules, "tests_manifest_registry", holder)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fam_one", "fam_two", "fam_none"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    assert registry.get("One") == 1
    assert "fam_one" in sys.modules and "fam_two" not in sys.modules
    assert registry.get("One") == 1  # imported once: a second import would register twice and raise
    with pytest.raises(ValueError, match="unknown test family 'Tow'. Did you mean 'Two'"):
        registry.get("Tow")
    assert "fam_two" in sys.modules
    with pytest.raises(RuntimeError, match="fam_none registers no test family 'Three'"):
        registry.get("Three")


def test_no_module_imports_a_family_for_its_side_effect() -> None:
    found = []
    for folder in ("packages/mm/src", "tests", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "mindspeed_mm.models":
                    names = {alias.name for alias in node.names} & FAMILY_MODULES
                elif isinstance(node, ast.Import):
                    names = {a.name for a in node.names if a.name.rpartition(".")[2] in FAMILY_MODULES}
                    names = {n for n in names if n.startswith("mindspeed_mm.models.")}
                else:
                    continue
                if names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {sorted(names)}")
    assert not found, "look the family up by name (FAMILIES / DIT_FAMILIES) instead:\n" + "\n".join(found)
