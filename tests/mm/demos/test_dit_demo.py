"""The text-to-video demo learns: held-out caption combinations get their colour far above chance after training.

``examples/mm/t2v_tiny_cpu.yaml`` (shortened) trains the demo's tiny Wan transformer on the
coloured-shape clips; the 8 held-out combinations of colour, shape and direction (never trained
on) are sampled from the untrained and the trained model with the same seeds, and the dominant
colour of each sample is compared with its caption (chance 1/4); the motion is not learned yet. Why:
:func:`~mindspeed_mm.demos.t2v.caption_losses` shows the trained model's loss rising with a wrong colour
word but not with the opposite direction word, nor with the frames shuffled (it has not learned to relate the
frames, and a direction exists only between frames). ``mindspeed-mm generate`` then writes the contact sheet of
the trained model from its DCP checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_mm.cli import main
from mindspeed_mm.demos.t2v import caption_losses, demo_paths, sample_heldout, score_videos
from tests.golden import check_golden, first_steps

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "mm" / "t2v_tiny_cpu.yaml"


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
    check_golden("mm_t2v_demo", first_steps(tmp_path / "metrics.jsonl", 10))
    after = score_videos(*sample_heldout(tmp_path / "hf", seeds=2, steps=10))
    print(f"held-out colour / direction before {before}, after training {after} (chance 0.25)")
    # measured: colour 0.125 before, 1.0 after (16 of 16); direction 0.25 before, 0.31 after: not learned
    # (0.25 after 600 steps; docs/mm/dit.md)
    assert before["colour"] <= 0.25 and after["colour"] >= 0.75
    losses = caption_losses(tmp_path / "hf")
    ratios = {key: [round(x / t, 3) for x, t in zip(losses[key], losses["true"])] for key in losses if key != "sigmas"}
    print(f"loss over the true caption's at sigmas {losses['sigmas']}: {ratios}")
    # measured: a wrong colour 1.035-1.27x (sigma 0.95-0.2), the opposite direction 0.997-1.0x, frames shuffled
    # 0.99-1.01x: the colour word is used; the direction word and the frames' order are not (docs/mm/dit.md)
    assert max(ratios["colour"]) > 1.1
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
