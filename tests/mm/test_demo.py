"""The README's recipe learns: held-out colour accuracy far above chance after a short run."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_mm.cli import main
from mindspeed_mm.demo import choice_accuracy, demo_paths

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "mm" / "vlm_tiny_cpu.yaml"


@pytest.mark.slow
def test_demo_recipe_learns_colours(tmp_path) -> None:
    paths = demo_paths()
    before = choice_accuracy(paths["model"], paths["heldout"], max_samples=60)
    assert main(["train", "--config", str(RECIPE), f"checkpoint.save={tmp_path}",
                 f"logging.dir={tmp_path}", f"checkpoint.save_hf={tmp_path / 'hf'}", "logging.progress=false"]) == 0
    after = choice_accuracy(tmp_path / "hf", paths["heldout"], max_samples=60)
    print(f"held-out accuracy before {before}, after training {after} (chance: colour 0.25, shape 0.33)")
    assert before["colour"] < 0.5 and after["colour"] >= 0.8
    assert (tmp_path / "loss.png").is_file() and (tmp_path / "metrics.jsonl").is_file()
