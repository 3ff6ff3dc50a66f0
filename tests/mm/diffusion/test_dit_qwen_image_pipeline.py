"""Qwen-Image against ``QwenImagePipeline`` on tiny components built in code (a tiny Qwen2.5-VL text encoder
with a byte tokenizer, an ``AutoencoderKLQwenImage`` with non-trivial ``latents_mean`` / ``latents_std``, the
family's tiny ``QwenImageTransformer2DModel``):

- text: the family's ``encode_prompts`` (zero-padded to the text length) and its mask equal ``encode_prompt``'s
  ``prompt_embeds`` and ``prompt_embeds_mask`` bit for bit (the template's 34 tokens dropped, prompts of
  different lengths); extract-features' encoder set (the saved pipeline directory) gives each caption's real
  tokens as ``encode_prompt`` of that caption alone;
- sampling: our loop with true CFG (norm-rescaled) gives the pipeline's latents and decoded image from the same
  masked embeddings and initial latents (the family's Qwen-Image scheduler: dynamic exponential shift with mu,
  shift_terminal);
- ``mindspeed-mm generate`` on the saved pipeline directory writes the images that the pipeline loaded with
  ``from_pretrained`` makes from the same prompts, empty negative prompt and seed noise, pixel for pixel.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import torch

from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
from mindspeed_mm.models.dit import DIT_FAMILIES
from mindspeed_mm.models.flux import pack_latents, unpack_latents
from mindspeed_mm.models.qwen_image import text_mask

QWEN_IMAGE = "QwenImageTransformer2DModel"
TEXT_LEN = 256
PROMPTS = ["a red square in the top left", "a blue circle"]


def _tiny_parts(tmp_path) -> dict:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from mindspeed_mm.models.qwen2_5_vl import write_tiny

    family = DIT_FAMILIES.get(QWEN_IMAGE)
    write_tiny(tmp_path / "qwen2_5_vl")
    torch.manual_seed(0)
    transformer = family.load_class()(**family.tiny_config).eval()
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 1.0],
    ).eval()
    return {
        "transformer": transformer,
        "scheduler": build_scheduler(family),
        "vae": vae,
        "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "qwen2_5_vl").eval(),
        "tokenizer": AutoTokenizer.from_pretrained(tmp_path / "qwen2_5_vl"),
    }


def test_qwen_image_prompts_and_extracted_text_equal_pipeline(tmp_path) -> None:
    from diffusers import QwenImagePipeline

    from mindspeed_mm.data.encoder_set import EncoderSet

    family = DIT_FAMILIES.get(QWEN_IMAGE)
    parts = _tiny_parts(tmp_path)
    pipe = QwenImagePipeline(**parts)
    captions = PROMPTS + [""]
    with torch.no_grad():
        theirs, theirs_mask = pipe.encode_prompt(captions, max_sequence_length=TEXT_LEN)
    lengths = theirs_mask.sum(1).tolist()
    assert len(set(lengths)) == 3 and theirs.shape[1] == max(lengths) < TEXT_LEN  # three lengths, padded
    text, pooled = family.encode_prompts(parts, captions, TEXT_LEN)
    assert pooled is None and text.shape == (3, TEXT_LEN, 64)
    assert torch.equal(text[:, : theirs.shape[1]], theirs) and not text[:, theirs.shape[1] :].any()
    cut, mask = text_mask(text)  # what the model is given
    assert torch.equal(cut, theirs) and torch.equal(mask, theirs_mask)

    pipe.save_pretrained(tmp_path / "pipe")
    encoders = EncoderSet(tmp_path / "pipe", QWEN_IMAGE, TEXT_LEN, torch.device("cpu"))
    for caption, length in zip(captions, lengths):  # one caption at a time, as extract-features encodes
        with torch.no_grad():
            alone, alone_mask = pipe.encode_prompt([caption], max_sequence_length=TEXT_LEN)
        assert alone_mask is None and alone.shape[1] == length
        assert torch.equal(encoders.encode_text(caption)["text"], alone[0])
    pixels = torch.rand(3, 16, 16) * 2 - 1
    latents = encoders.encode_pixels(pixels)  # an image through the 3-D VAE as one frame, normalised
    assert latents.shape == (4, 4, 4)


def test_qwen_image_sampler_equals_pipeline_with_true_cfg(tmp_path) -> None:
    from diffusers import QwenImagePipeline

    family = DIT_FAMILIES.get(QWEN_IMAGE)
    parts = _tiny_parts(tmp_path)
    model, vae, scheduler = parts["transformer"], parts["vae"], parts["scheduler"]
    assert scheduler.config.use_dynamic_shifting and scheduler.config.time_shift_type == "exponential"
    pipe = QwenImagePipeline(**{**parts, "scheduler": copy.deepcopy(scheduler)})
    gen = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    text, negative = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    text[1, 3:] = 0  # the second prompt has 3 real tokens: a mask for the conditional call
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    kwargs = {
        "prompt_embeds": text,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": negative,
        "negative_prompt_embeds_mask": torch.ones(2, 3, dtype=torch.long),
        "latents": pack_latents(latents),
        "height": 32,
        "width": 32,
        "num_inference_steps": 3,
        "true_cfg_scale": 2.5,
    }
    theirs_latents = unpack_latents(pipe(**kwargs, output_type="latent").images, 8, 8)
    theirs_image = pipe(**kwargs, output_type="pt").images

    def padded(u):
        return torch.cat([u, u.new_zeros(u.shape[0], TEXT_LEN - u.shape[1], u.shape[2])], dim=1)

    ours_latents = sample_latents(
        model, family, scheduler, latents, padded(text), 3, negative_text=padded(negative), guidance_scale=2.5
    )
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    ours_image = decode_latents(vae, ours_latents)
    assert ours_image.shape == theirs_image.shape == (2, 3, 32, 32)
    torch.testing.assert_close(ours_image, theirs_image, rtol=1e-6, atol=1e-6)
    assert (ours_latents - latents).abs().mean() > 0.1  # it moved
    plain = sample_latents(  # the norm rescale matters: plain CFG lands elsewhere
        model,
        dataclasses.replace(family, combine_guidance=None),
        copy.deepcopy(scheduler),
        latents,
        padded(text),
        3,
        negative_text=padded(negative),
        guidance_scale=2.5,
    )
    assert (plain - theirs_latents).abs().max() > 1e-3


def test_generate_qwen_image_equals_pipeline(tmp_path) -> None:
    from diffusers import QwenImagePipeline
    from PIL import Image

    from mindspeed_mm.cli import main
    from mindspeed_mm.diffusion.media import to_uint8

    pipe_dir = tmp_path / "pipe"
    QwenImagePipeline(**_tiny_parts(tmp_path)).save_pretrained(pipe_dir)
    flags = ["--height", "32", "--width", "32", "--num-inference-steps", "3", "--text-len", str(TEXT_LEN)]
    flags += ["--guidance-scale", "3", "--seed", "7", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    # one prompt a batch, as the pipeline is called below (a batch pads the shorter prompt for the text
    # encoder, which rounds its real tokens' states differently in the last bit)
    flags += ["--batch-size", "1"]
    out = tmp_path / "out"
    assert main(["generate", "--load-dir", str(pipe_dir), "--output-dir", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [7, 8]
    assert rows[0]["settings"]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    reference = QwenImagePipeline.from_pretrained(pipe_dir)
    for index, (row, prompt) in enumerate(zip(rows, PROMPTS)):
        noise = torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(7 + index))[None]
        image = reference(
            prompt=prompt,
            negative_prompt="",
            latents=pack_latents(noise),
            height=32,
            width=32,
            num_inference_steps=3,
            true_cfg_scale=3.0,
            max_sequence_length=TEXT_LEN,
            output_type="pt",
        ).images
        with Image.open(row["files"][0]) as written:
            np.testing.assert_array_equal(np.asarray(written.convert("RGB")), to_uint8(image)[0])
