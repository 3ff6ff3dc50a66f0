"""Inside mindspeed_mm, folders import only down the floors its package docstring lists: no folder-level cycle.

A unit is a top-level folder of the package (``mindspeed_mm.trainer``) or a top-level module
(``mindspeed_mm.cli``). The import graph is the one of tests/sanity/test_imports.py, read from the
source with ``ast``: module-level and function-level imports alike (a lazy import hides a
dependency, it does not remove it). An import from one unit into another must go to a lower floor;
a loop of units is reported as such.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.sanity.test_imports import ROOT, cycles, import_graph

PACKAGE = "mindspeed_mm"
INIT = ROOT / "packages" / "mm" / "src" / PACKAGE / "__init__.py"
_FLOOR = re.compile(r"^\s*floor\s+(\d+)\s+(\S.*)$")


def documented_floors(init: Path = INIT) -> dict[str, int]:
    """``unit -> floor`` from the ``floor N  a, b`` lines of the package docstring in ``init``."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    floors = {}
    for line in doc.splitlines():
        match = _FLOOR.match(line)
        if match:
            for unit in match.group(2).split(","):
                floors[unit.strip()] = int(match.group(1))
    return floors


def unit_of(module: str, package: str = PACKAGE) -> str | None:
    """``mindspeed_mm.trainer.loop`` -> ``trainer``; the package itself and other packages -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else None


def unit_graph(graph: dict[str, dict[str, int]], package: str = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """``unit -> {unit it imports: ["module -> module", ...]}`` (imports inside a unit left out)."""
    units: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        source = unit_of(module, package)
        if source is None:
            continue
        units.setdefault(source, {})
        for target in targets:
            unit = unit_of(target, package)
            if unit is not None and unit != source:
                units[source].setdefault(unit, []).append(f"{module} -> {target}")
    return units


def layer_faults(units: dict[str, dict[str, list[str]]], floors: dict[str, int], package: str = PACKAGE) -> list[str]:
    """Every unit missing from the table, every unit loop, and every import that is not to a lower floor."""
    faults = [
        f"{unit}: not in the floor table of {package}/__init__.py; add it" for unit in units if unit not in floors
    ]
    for loop in cycles({unit: dict.fromkeys(targets, 0) for unit, targets in units.items()}):
        faults.append("folders import each other: " + " <-> ".join(loop))
    for unit, targets in sorted(units.items()):
        for target, where in sorted(targets.items()):
            if unit in floors and target in floors and floors[target] >= floors[unit]:
                faults.append(
                    f"{unit} (floor {floors[unit]}) imports {target} (floor {floors[target]}): {'; '.join(where[:3])}"
                )
    return faults


def test_mm_folders_import_down_the_floors() -> None:
    graph, _ = import_graph()
    floors = documented_floors()
    units = unit_graph(graph)
    assert {"config", "models", "data", "trainer", "demos", "cli"} <= set(units), "the graph must cover the package"
    assert set(floors) == set(units), (
        f"the floor table names units that do not exist: {sorted(set(floors) - set(units))}"
    )
    faults = layer_faults(units, floors)
    assert not faults, (
        f"{PACKAGE} folders against their layers (move the shared part down, or resolve it in the caller):\n"
        + "\n".join(faults)
    )


def test_the_layer_check_sees_loops_and_upward_imports() -> None:
    graph = {
        "mindspeed_mm.data.extract": {"mindspeed_mm.diffusion.encoders": 3, "mindspeed_mm.data.media": 4},
        "mindspeed_mm.diffusion.demo": {"mindspeed_mm.data.features": 9, "mindspeed": 1},
        "mindspeed_mm.models.wan": {"mindspeed_mm.models.dit": 1},
        "mindspeed_mm.cli": {"mindspeed_mm": 1},
    }
    units = unit_graph(graph)
    assert units == {
        "data": {"diffusion": ["mindspeed_mm.data.extract -> mindspeed_mm.diffusion.encoders"]},
        "diffusion": {"data": ["mindspeed_mm.diffusion.demo -> mindspeed_mm.data.features"]},
        "models": {},
        "cli": {},
    }
    faults = layer_faults(units, {"data": 3, "diffusion": 3, "models": 2})
    assert faults == [
        "cli: not in the floor table of mindspeed_mm/__init__.py; add it",
        "folders import each other: data <-> diffusion",
        "data (floor 3) imports diffusion (floor 3): mindspeed_mm.data.extract -> mindspeed_mm.diffusion.encoders",
        "diffusion (floor 3) imports data (floor 3): mindspeed_mm.diffusion.demo -> mindspeed_mm.data.features",
    ]
    assert documented_floors()["config"] == 1, "the package docstring's floor table was not read"
