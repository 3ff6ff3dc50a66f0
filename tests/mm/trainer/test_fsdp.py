"""FSDP2 data parallelism, resume and export, in one spawned group of two gloo ranks.

- DP2 (one microbatch per rank, language layers recomputed) equals DP1 (two accumulated
  microbatches, no recompute) step by step: losses and gradient norms over 4 steps (Qwen2.5-VL)
  and 2 steps each for Qwen3-VL (whose DeepStack mergers the dummy vision pass must reach too)
  and InternVL (whose projector sits outside the vision tower), and LoRA on Qwen2.5-VL (its
  factors initialised on rank 0 and broadcast with the weights), and Qwen2.5-VL on videos (a rank
  without a video or an image runs the dummy passes, so both ranks make two vision-tower calls;
  samples encoded by 2 workers into a cache that rank 0 writes and rank 1 reads), and Qwen2.5-VL
  over 3 steps whose middle one has no image on any rank (the vision tower's gradients of zeros from
  the dummy passes are dropped, so AdamW skips the tower as on one rank; with them, step 3's loss
  moved by 6e-4 relative).
- A run resumed from the step-2 checkpoint repeats steps 3-4 of the uninterrupted run bit for bit,
  with the language layers' saved activations swapped to the host (``train.swap_modules``) and
  ``train.deterministic`` where the uninterrupted run recomputed those layers.
- The validation loss after steps 2 and 4 (5 held-out samples, one a microbatch: 3 on rank 0 and
  2 plus a stand-in forward on rank 1) equals DP1's, and the resumed run's step-4 one.
- The Hugging Face export loads in transformers with no missing or unexpected keys and holds
  exactly the weights of the last DCP checkpoint; Qwen3-VL's export loads with no missing or
  unexpected keys and has the source directory's tensor names.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mindspeed.launch import launch
from mindspeed.testing.distributed import run_distributed
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.trainer.loop import train

STEPS = 4


def _overrides(model_dir: Path, data: Path, accumulation: int) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.files=[{data}]",
        f"train.steps={STEPS}",
        "train.micro_batch_size=1",
        f"train.gradient_accumulation_steps={accumulation}",
        "train.precision=fp32",
        "train.lr=1e-3",
        "train.lr_warmup_steps=1",
        "train.weight_decay=0.1",
        "train.clip_grad=1.0",
        "logging.progress=false",
        "data.image_min_pixels=784",
        "data.image_max_pixels=12544",
    ]


def _dp2(rank: int, world: int, base: list[str], root: Path, others: list[list[str]]) -> dict | None:
    full = train(
        load_mm_config(
            None,
            base
            + [
                f"checkpoint.save={root / 'full'}",
                "checkpoint.interval=2",
                f"checkpoint.save_hf={root / 'hf'}",
                "train.recompute_modules=[model.language_model.layers.*]",
            ],
        )
    )
    if rank == 0:
        shutil.copytree(root / "full" / "step_00000002", root / "resumed" / "step_00000002")
    dist.barrier()
    # Resumed with the language layers' activations swapped to the host instead of recomputed,
    # deterministically: the same numbers either way.
    swap = ["train.swap_modules=[model.language_model.layers.*]", "train.deterministic=true"]
    resumed = train(
        load_mm_config(None, base + [f"checkpoint.save={root / 'resumed'}", "checkpoint.save_at_end=false", *swap])
    )
    other = [record for overrides in others for record in train(load_mm_config(None, overrides)).records]
    return (
        {
            "full": full.records,
            "resumed": resumed.records,
            "start": resumed.start_step,
            "others": other,
            "evals": full.evals,
            "resumed_evals": resumed.evals,
        }
        if rank == 0
        else None
    )


def _dp1(config):
    result = train(config)
    return result.records, result.evals


def _text_step_data(data: Path) -> Path:
    """Two image samples, two text-only ones, two image ones: step 2 of a 2-sample step has no image."""
    lines = data.read_text().splitlines()
    images = [line for line in lines if '"images"' in line]
    texts = [line for line in lines if '"images"' not in line]
    rows = [images[0], images[1], texts[0], texts[1], images[2], images[3]]
    target = data.parent / "text-step.jsonl"  # beside the images the rows name
    target.write_text("".join(row + "\n" for row in rows))
    return target


def test_dp2_equals_dp1_resume_and_export(
    tiny_vlm, tiny_qwen3_vl, tiny_internvl, tiny_video_data, tiny_valid, tmp_path
) -> None:
    model_dir, data = tiny_vlm
    valid = [f"data.valid_files=[{tiny_valid}]", "eval.interval=2"]
    lora = ["lora.target_modules=[q_proj, v_proj, qkv]", "lora.parts=[language_model, vision_tower]", "lora.r=4"]
    video = (model_dir, tiny_video_data)
    cached = ["data.video_fps=4", "data.video_maxlen=6", "data.workers=2", f"data.cache_dir={tmp_path / 'cache'}"]
    text_step = (model_dir, _text_step_data(data))
    runs = ((tiny_qwen3_vl, []), (tiny_internvl, []), (tiny_vlm, lora), (video, cached))
    runs += ((text_step, ["train.steps=3", "data.shuffle=false"]),)
    others = [_overrides(*tiny, 1) + ["train.steps=2"] + extra for tiny, extra in runs]
    others[0].append(f"checkpoint.save_hf={tmp_path / 'qwen3-hf'}")
    dp2 = run_distributed(_dp2, 2, _overrides(model_dir, data, 1) + valid, tmp_path, others, timeout=300)[0]
    dp1, dp1_evals = launch(_dp1, (load_mm_config(None, _overrides(model_dir, data, 2) + valid),))
    for tiny, extra in runs:
        dp1 += launch(_dp1, (load_mm_config(None, _overrides(*tiny, 2) + ["train.steps=2"] + extra),))[0]
    assert [r["step"] for r in dp2["full"]] == [r["step"] for r in dp1[:STEPS]] == list(range(1, STEPS + 1))
    for one, two in zip(dp1, dp2["full"] + dp2["others"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["step"]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), one["step"]
    assert dp1[STEPS - 1]["loss"] < dp1[0]["loss"]  # it learns
    assert [r["step"] for r in dp2["evals"]] == [r["step"] for r in dp1_evals] == [2, 4]
    for one, two in zip(dp1_evals, dp2["evals"]):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5) and two["tokens"] == one["tokens"], one["step"]
    assert dp1_evals[1]["loss"] < dp1_evals[0]["loss"]
    assert [(r["step"], r["loss"]) for r in dp2["resumed_evals"]] == [(4, dp2["evals"][1]["loss"])]

    assert dp2["start"] == 2 and [r["step"] for r in dp2["resumed"]] == [3, 4]
    for resumed, full in zip(dp2["resumed"], dp2["full"][2:]):
        assert (resumed["loss"], resumed["grad_norm"]) == (full["loss"], full["grad_norm"])

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import Qwen2_5_VLForConditionalGeneration

    exported, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    dcp_to_torch_save(tmp_path / "full" / f"step_{STEPS:08d}", tmp_path / "last.pt")
    trained = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    weights = exported.state_dict()
    assert set(trained) == set(weights)
    for name, value in trained.items():
        assert torch.equal(weights[name], value), name

    from safetensors.torch import load_file
    from transformers import Qwen3VLForConditionalGeneration

    _, info = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "qwen3-hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    source = load_file(tiny_qwen3_vl[0] / "model.safetensors")
    assert set(load_file(tmp_path / "qwen3-hf" / "model.safetensors")) == set(source)
