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


def test_omni_lora_peft_adapter_equals_merged_export(tmp_path) -> None:
    """LoRA on the thinker's language model and audio tower (q_proj / v_proj, r 4): the first loss equals the
    full model's (B = 0), the loss falls, the merged export loads in transformers with no missing keys, and
    peft's ``PeftModel`` over the base thinker with the saved adapter gives the merged export's logits."""
    import torch
    from peft import PeftModel
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    model_dir = write_tiny_model(tmp_path / "omni", "Qwen2_5OmniThinkerForConditionalGeneration")
    train = write_tiny_audio_dataset(tmp_path / "train", num_samples=8, seed=3)
    overrides = [
        f"model.path={model_dir}",
        f"data.files=[{train}]",
        "data.shuffle=false",
        "train.micro_batch_size=4",
        "train.precision=fp32",
        "logging.progress=false",
    ]
    lora = [
        "train.steps=6",
        "train.lr=2e-2",
        "lora.target_modules=[q_proj, v_proj]",
        "lora.parts=[language_model, vision_tower]",
        "lora.r=4",
        "lora.alpha=8",
        f"lora.save_peft={tmp_path / 'peft'}",
        f"checkpoint.save_hf={tmp_path / 'merged'}",
        f"logging.dir={tmp_path / 'lora'}",
    ]
    assert main(["train", *overrides, *lora]) == 0
    assert main(["train", *overrides, "train.steps=1", f"logging.dir={tmp_path / 'full'}"]) == 0

    def losses(folder: str) -> list[float]:
        lines = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]

    trained, full = losses("lora"), losses("full")
    assert trained[0] == full[0] and trained[-1] < trained[0] * 0.9
    merged, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        tmp_path / "merged", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    base = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir)
    adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    from mindspeed_mm.data import read_mllm_files
    from mindspeed_mm.data.preprocess import EncodeSettings, Processing
    from mindspeed_mm.models import family_of, load_audio_processor, load_processing

    tokenizer, processor = load_processing(model_dir, 784, 12544)
    processing = Processing(tokenizer, processor, family_of(model_dir), None, load_audio_processor(model_dir))
    sample = processing.encode(read_mllm_files([str(train)])[2], EncodeSettings(cutoff_len=1024))  # image + audio
    ids = sample.input_ids[None]
    with torch.no_grad():
        ours = merged.eval()(input_ids=ids, attention_mask=torch.ones_like(ids), **sample.vision).logits
        theirs = adapted(input_ids=ids, attention_mask=torch.ones_like(ids), **sample.vision).logits
        untrained = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir).eval()  # peft wrapped `base`
        plain = untrained(input_ids=ids, attention_mask=torch.ones_like(ids), **sample.vision).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert (ours - plain).abs().max() > 1e-3  # the adapter changed the model
    print(f"Omni LoRA: loss {trained[0]:.3f} -> {trained[-1]:.3f}; merged = PEFT logits")
