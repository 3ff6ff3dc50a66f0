"""Inside mindspeed_rl, folders import only down the floors its package docstring lists.

The floor table in ``mindspeed_rl/__init__.py`` puts the driver above the workers, the workers
above the models, and algorithms, buffer, data, rewards and tools on the ground floor (rollout, which runs the
tools in its agent loop, one above): so a Ray
worker never imports the driver (what it imports is what the driver ships to it), and the
algorithms import nothing of rl but themselves. The graph is the one of
tests/sanity/test_imports.py (module-level and function-level imports, read with ``ast``); the
checker is tests/sanity/test_mm_layers.py's, with the rl package.
"""

from __future__ import annotations

from tests.sanity.test_imports import ROOT, import_graph
from tests.sanity.test_mm_layers import documented_floors, layer_faults, unit_graph

PACKAGE = "mindspeed_rl"
INIT = ROOT / "packages" / "rl" / "src" / PACKAGE / "__init__.py"


def test_rl_folders_import_down_the_floors() -> None:
    graph, _ = import_graph()
    floors = documented_floors(INIT)
    units = unit_graph(graph, PACKAGE)
    assert {"algorithms", "config", "models", "workers", "driver", "cli"} <= set(units), "the graph must cover rl"
    assert set(floors) == set(units), f"the floor table and the package differ: {sorted(set(floors) ^ set(units))}"
    assert floors["workers"] < floors["driver"] and floors["models"] < floors["workers"]
    assert floors["algorithms"] == min(floors.values()), "the algorithms stand on the ground floor"
    faults = layer_faults(units, floors, PACKAGE)
    assert not faults, (
        f"{PACKAGE} folders against their layers (move the shared part down, or resolve it in the caller):\n"
        + "\n".join(faults)
    )


def test_a_worker_importing_the_driver_is_caught() -> None:
    """A planted function-level import of the driver from a worker, and algorithms reaching up."""
    graph = {
        "mindspeed_rl.workers.actor_worker": {"mindspeed_rl.driver.trainer": 40, "mindspeed_rl.models.actor": 3},
        "mindspeed_rl.algorithms.losses": {"mindspeed_rl.algorithms.kl": 2, "mindspeed_rl.rewards.base": 5},
        **{
            name: {}
            for name in ("mindspeed_rl.driver.trainer", "mindspeed_rl.models.actor", "mindspeed_rl.rewards.base")
        },
    }
    floors = documented_floors(INIT)
    faults = layer_faults(unit_graph(graph, PACKAGE), floors, PACKAGE)
    assert faults == [
        f"algorithms (floor {floors['algorithms']}) imports rewards (floor {floors['rewards']}): "
        "mindspeed_rl.algorithms.losses -> mindspeed_rl.rewards.base",
        f"workers (floor {floors['workers']}) imports driver (floor {floors['driver']}): "
        "mindspeed_rl.workers.actor_worker -> mindspeed_rl.driver.trainer",
    ]
