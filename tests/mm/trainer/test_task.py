"""The training tasks by name: one manifest, a task's module imported when its name is first looked up.

No module imports a task module for its side effect (``from mindspeed_mm.trainer import dit_task  # noqa``):
importing the trainer loads no task, and ``TASKS.get(name)`` imports the one it needs.
"""

from __future__ import annotations

import importlib
import sys

import mindspeed_mm.trainer
from mindspeed_mm.trainer.task import TASK_MODULES, TASKS

FRESH = ("mindspeed_mm.trainer.loop", "mindspeed_mm.trainer.task", *TASK_MODULES.values())


def test_every_task_is_in_the_manifest_and_registered_by_its_module() -> None:
    assert sorted(TASKS) == sorted(TASK_MODULES) == ["dit", "vlm"]
    for name, module in TASK_MODULES.items():
        assert TASKS.get(name).__module__ == module


def test_importing_the_loop_loads_no_task_until_one_is_looked_up(monkeypatch) -> None:
    for name in FRESH:  # import these anew here; the originals come back after the test
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(mindspeed_mm.trainer, name.rpartition(".")[2], None, raising=False)
    importlib.import_module("mindspeed_mm.trainer.loop")
    assert not [name for name in TASK_MODULES.values() if name in sys.modules]
    fresh = sys.modules["mindspeed_mm.trainer.task"].TASKS
    assert fresh.get("dit").__name__ == "DiTTask"
    assert TASK_MODULES["dit"] in sys.modules and TASK_MODULES["vlm"] not in sys.modules
