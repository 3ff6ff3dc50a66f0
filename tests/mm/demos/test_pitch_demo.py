"""Qwen2.5-Omni SFT through ``mindspeed-mm train`` learns the pitch demo, and its export loads in transformers.

A tiny thinker trained 30 steps (16 tone clips, microbatches of 4) through the CLI: the loss falls,
the held-out pitch accuracy (:func:`~mindspeed_mm.demos.pitch.pitch_accuracy`, 32 new clips)
rises from chance, and the exported directory loads as ``Qwen2_5OmniThinkerForConditionalGeneration``
with no missing, unexpected or mismatched keys, its feature extractor beside it.
"""

from __future__ import annotations

import json

from mindspeed_mm.cli import main
from mindspeed_mm.demos.pitch import pitch_accuracy
from mindspeed_mm.testing import write_tiny_audio_dataset, write_tiny_model


def test_omni_sft_learns_pitch_and_exports(tmp_path) -> None:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    model_dir = write_tiny_model(tmp_path / "omni", "Qwen2_5OmniThinkerForConditionalGeneration")
    train = write_tiny_audio_dataset(tmp_path / "train", num_samples=16, seed=3, image_every=0, text_only_every=0)
    heldout = write_tiny_audio_dataset(tmp_path / "heldout", num_samples=32, seed=9, image_every=0, text_only_every=0)
    before = pitch_accuracy(model_dir, heldout)
    overrides = [
        f"model.path={model_dir}",
        f"data.files=[{train}]",
        "train.steps=30",
        "train.micro_batch_size=4",
        "train.lr=3e-3",
        "train.lr_warmup_steps=2",
        "train.precision=fp32",
        "logging.progress=false",
        f"logging.dir={tmp_path / 'log'}",
        f"checkpoint.save_hf={tmp_path / 'hf'}",
    ]
    assert main(["train", *overrides]) == 0
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    after = pitch_accuracy(tmp_path / "hf", heldout)
    print(f"Omni pitch demo: loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out accuracy {before:.2f} -> {after:.2f}")
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] / 10
    assert before <= 0.75 and after >= 0.9

    loaded, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (tmp_path / "hf" / "audio_processor" / "preprocessor_config.json").is_file()
