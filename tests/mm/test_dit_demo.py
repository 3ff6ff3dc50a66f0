"""The text-to-video demo learns: held-out caption combinations get their colour far above chance after training.

``examples/mm/t2v_tiny_cpu.yaml`` (shortened) trains the demo's tiny Wan transformer on the
coloured-shape clips; the 8 held-out combinations of colour, shape and direction (never trained
on) are sampled from the untrained and the trained model with the same seeds, and the dominant
colour of each sample is compared with its caption (chance 1/4); the motion is not learned yet. ``mindspeed-mm generate`` then
writes the contact sheet of the trained model from its DCP checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_mm.cli import main
from mindspeed_mm.diffusion.demo import demo_paths, sample_heldout, score_videos

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "mm" / "t2v_tiny_cpu.yaml"


@pytest.mark.slow
def test_t2v_demo_learns_colours(tmp_path) -> None:
    paths = demo_paths()
    before = score_videos(*sample_heldout(paths["transformer"], seeds=2, steps=10))
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
                "train.steps=300",
            ]
        )
        == 0
    )
    after = score_videos(*sample_heldout(tmp_path / "hf", seeds=2, steps=10))
    print(f"held-out colour / direction before {before}, after training {after} (chance 0.25)")
    # measured: colour 0.125 before, 1.0 after (16 of 16); direction 0.25 before, 0.31 after: not learned
    # (0.25 after 600 steps; docs/mm/dit.md)
    assert before["colour"] <= 0.25 and after["colour"] >= 0.75
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(tmp_path),
                "--base-dir",
                "demo-t2v",
                "--prompts-file",
                "demo-t2v",
                "--num-frames",
                "4",
                "--height",
                "24",
                "--width",
                "24",
                "--text-len",
                "8",
                "--guidance-scale",
                "4",
                "--num-inference-steps",
                "10",
                "--output-dir",
                str(tmp_path / "samples"),
            ]
        )
        == 0
    )
    assert (tmp_path / "samples" / "contact_sheet.gif").is_file()
