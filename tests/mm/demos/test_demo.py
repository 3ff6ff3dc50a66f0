"""The README's recipe learns: held-out colour accuracy far above chance after a short run.

``mindspeed-mm evaluate`` on the demo's held-out MMBench-style TSV (``--task-data-path demo``)
shows the same rise from the training checkpoint (DCP) and gives the accuracies of
:func:`~mindspeed_mm.demos.vlm.choice_accuracy` on the same 60 questions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_mm.cli import main
from mindspeed_mm.demos.vlm import choice_accuracy, demo_paths
from tests.golden import check_golden, first_steps

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "mm" / "vlm_tiny_cpu.yaml"


@pytest.mark.slow
def test_demo_recipe_learns_colours(tmp_path) -> None:
    paths = demo_paths()
    before = choice_accuracy(paths["model"], paths["heldout"], max_samples=60)
    assert (
        main(
            [
                "train",
                "--config",
                str(RECIPE),
                f"checkpoint.save={tmp_path}",
                f"logging.dir={tmp_path}",
                f"checkpoint.save_hf={tmp_path / 'hf'}",
                "logging.progress=false",
            ]
        )
        == 0
    )
    after = choice_accuracy(tmp_path / "hf", paths["heldout"], max_samples=60)
    print(f"held-out accuracy before {before}, after training {after} (chance: colour 0.25, shape 0.33)")
    assert before["colour"] < 0.5 and after["colour"] >= 0.8
    assert (tmp_path / "loss.png").is_file() and (tmp_path / "metrics.jsonl").is_file()
    check_golden("mm_vlm_demo", first_steps(tmp_path / "metrics.jsonl", 10))

    scores = {}
    for name, load in (
        ("before", ["--load-dir", "demo"]),
        ("after", ["--load-dir", str(tmp_path), "--base-dir", "demo"]),
    ):
        out = tmp_path / f"eval-{name}.json"
        assert (
            main(
                [
                    "evaluate",
                    *load,
                    "--task-data-path",
                    "demo",
                    "--choice-prompt",
                    "cloze",
                    "--max-samples",
                    "60",
                    "--image-min-pixels",
                    "784",
                    "--image-max-pixels",
                    "3136",
                    "--output",
                    str(out),
                ]
            )
            == 0
        )
        scores[name] = json.loads(out.read_text())["results"][0]
    print(f"evaluate: acc before {scores['before']['value']:.3f}, after {scores['after']['value']:.3f}")
    for name, accuracy in (("before", before), ("after", after)):
        groups = scores[name]["groups"]
        assert {kind: groups[kind]["acc"] for kind in groups} == pytest.approx(accuracy, abs=1e-9), name
    assert scores["after"]["value"] >= scores["before"]["value"] + 0.25
