"""mindspeed_rl's Ray workers never import the driver (``runner``, ``trainer``, the CLIs).

A worker runs in its own process: what it imports is what the driver ships to it. The recipe's
translation into actor settings lives in :mod:`mindspeed_rl.models.actor_settings` for that reason.
Read from the source with ``ast`` (module-level and function-level imports), nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[2] / "packages/rl/src/mindspeed_rl/workers"
DRIVER = (
    "mindspeed_rl.driver.runner",
    "mindspeed_rl.driver.runner_checkpoints",
    "mindspeed_rl.driver.trainer",
    "mindspeed_rl.driver.grpo_cli",
    "mindspeed_rl.driver.ppo_runner",
    "mindspeed_rl.driver.ppo_trainer",
    "mindspeed_rl.driver.ppo_cli",
)


def driver_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a driver module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] if _is_driver(node.module) else [f"{node.module}.{a.name}" for a in node.names]
        found += [(node.lineno, n) for n in names if _is_driver(n)]
    return sorted(found)


def _is_driver(module: str) -> bool:
    return module in DRIVER or module.startswith(tuple(f"{d}." for d in DRIVER))


def test_workers_do_not_import_the_driver() -> None:
    files = sorted(WORKERS.rglob("*.py"))
    assert len(files) > 3
    wrong = [f"{p.name}:{line} imports {name}" for p in files for line, name in driver_imports(p.read_text())]
    assert not wrong, "a Ray worker imports the driver: " + "; ".join(wrong)
    # The scan sees imports inside functions and ``from package import module`` too.
    planted = "def f():\n    from mindspeed_rl.driver.trainer import x\nfrom mindspeed_rl.driver import runner\n"
    assert [name for _, name in driver_imports(planted)] == [
        "mindspeed_rl.driver.trainer",
        "mindspeed_rl.driver.runner",
    ]
