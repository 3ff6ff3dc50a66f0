"""Qwen-Image LoRA, export and conversion against diffusers.

One launch trains the tiny ``QwenImageTransformer2DModel`` for 2 steps with LoRA on the family's default targets
(both streams' attention projections, r 4, alpha 8) and for 2 steps in full:

- the run's ``lora.save_peft`` loaded by diffusers' own ``QwenImagePipeline.load_lora_weights`` gives
  the transformer output of the run's model (the base with the last DCP checkpoint's LoRA factors) within
  1e-5, and so does the merged ``checkpoint.save_hf``; the LoRA moved the output;
- every export (merged LoRA, full fine-tuning) loads in ``QwenImageTransformer2DModel.from_pretrained`` with no
  missing, unexpected or mismatched keys; the full run's export holds exactly its last DCP checkpoint;
- ``convert`` hf -> dcp -> hf is bit-identical; dcp -> lora gives the run's adapter.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from mindspeed.launch import launch
from mindspeed_mm.config import MMLoraConfig, load_mm_config
from mindspeed_mm.models.dit import DIT_FAMILIES, load_dit
from mindspeed_mm.models.lora import apply_lora
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.loop import train
from tests.mm.models.test_dit_lora import _convert, _same, _state, _weights

QWEN_IMAGE = "QwenImageTransformer2DModel"
LORA = MMLoraConfig(target_modules=["default"], r=4, alpha=8.0)
STEP = "step_00000002"


def _overrides(run: tuple[Path, Path], **extra) -> list[str]:
    values = {
        "model.path": run[0],
        "data.features": run[1],
        "data.text_len": 8,
        "train.precision": "fp32",
        "train.steps": 2,
        "train.micro_batch_size": 2,
        "train.lr": 0.05,
        "logging.progress": "false",
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def _train(root: Path, run) -> None:
    lora = {"lora.target_modules": "[default]", "lora.r": 4, "lora.alpha": 8}
    paths = {"lora.save_peft": root / "lora", "checkpoint.save_hf": root / "merged", "checkpoint.save": root / "ckpt"}
    train(load_mm_config(None, _overrides(run, **lora, **paths)))
    full = {"train.lr": 0.01, "checkpoint.save": root / "full_ckpt", "checkpoint.save_hf": root / "full"}
    train(load_mm_config(None, _overrides(run, **full)))


def _output(model) -> torch.Tensor:
    family = DIT_FAMILIES.get(QWEN_IMAGE)
    gen = torch.Generator().manual_seed(3)
    latents, text = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 8, 64, generator=gen)
    text[1, 5:] = 0  # a shorter second text: the mask
    inputs = family.model_inputs(model.config, latents, torch.tensor([0.3, 0.8]), text, None, 1.0)
    assert inputs["encoder_hidden_states_mask"] is not None
    with torch.no_grad():
        return model.eval()(**inputs)[0]


def test_qwen_image_lora_and_exports_load_in_diffusers(capsys, tmp_path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    family = DIT_FAMILIES.get(QWEN_IMAGE)
    run = write_tiny_dit_run(tmp_path / "base", QWEN_IMAGE)
    root = tmp_path / "runs"
    launch(_train, (root, run))

    # the run's model: the base with its LoRA layers and the last checkpoint's factors
    ours = load_dit(run[0], family)
    apply_lora(ours, LORA, family)
    saved = _state(root / "ckpt" / STEP, tmp_path / "lora.pt")["model"]
    assert saved and all(".lora_" in name for name in saved)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in saved}
    assert {"to_q", "add_q_proj", "to_add_out", "0"} <= adapted  # both streams (to_out.0 ends in "0")
    missing, unexpected = ours.load_state_dict(saved, strict=False)
    assert not unexpected and all(".lora_" not in name for name in missing)
    expected = _output(ours)

    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=load_dit(run[0], family),
    )
    pipe.load_lora_weights(str(root / "lora"))
    assert pipe.transformer.peft_config["default_0"].lora_alpha == 8.0
    diffusers_lora = _output(pipe.transformer)
    merged, info = QwenImageTransformer2DModel.from_pretrained(root / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    merged = _output(merged)
    base = _output(load_dit(run[0], family))
    message = (
        f"Qwen-Image: |load_lora_weights - run| {float((diffusers_lora - expected).abs().max()):.2e}, "
        f"|merged - run| {float((merged - expected).abs().max()):.2e}, |run - base| "
        f"{float((expected - base).abs().max()):.2e}"
    )
    with capsys.disabled():
        print(message)
    torch.testing.assert_close(diffusers_lora, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    assert float((expected - base).abs().max()) > 1e-2  # the LoRA trained

    # full fine-tuning: the export is a diffusers directory holding exactly the last checkpoint
    full, info = QwenImageTransformer2DModel.from_pretrained(root / "full", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = _state(root / "full_ckpt" / STEP, tmp_path / "full.pt")["model"]
    _same(full.state_dict(), trained)
    before = _weights(run[0])
    assert not all(torch.equal(before[name], value) for name, value in trained.items())  # it trained

    # convert: hf -> dcp -> hf bit-identical; dcp -> lora the run's adapter
    assert _convert(capsys, "hf", "dcp", run[0], tmp_path / "dcp")[0] == 0
    assert _convert(capsys, "dcp", "hf", tmp_path / "dcp", tmp_path / "hf", "--base-dir", str(run[0]))[0] == 0
    assert (tmp_path / "hf" / "config.json").read_bytes() == (run[0] / "config.json").read_bytes()
    _same(_weights(tmp_path / "hf"), before)
    assert _convert(capsys, "dcp", "lora", root / "ckpt", tmp_path / "lora")[0] == 0
    _same(
        load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors"),
        load_file(root / "lora" / "pytorch_lora_weights.safetensors"),
    )
