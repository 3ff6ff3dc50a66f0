"""Qwen-Image-Edit: Qwen-Image's transformer conditioned on a source image, as ``QwenImageEditPipeline`` runs it.

A pipeline directory whose ``model_index.json`` names ``QwenImageEditPipeline`` selects this family (the
``edit`` variant of ``QwenImageTransformer2DModel``; the transformer's config is Qwen-Image's). The source
image is resized to about :data:`CONDITION_AREA` pixels at its own aspect ratio (the pipeline's
``calculate_dimensions``, multiples of 32) and

- VAE-encoded to normalised latents ``image_latents`` ``[C, h, w]`` (the posterior's mode), packed into 2x2
  patches and concatenated after the noisy target's tokens on the sequence, with ``img_shapes`` of two shapes
  per sample (target, condition) for the rotary table; the prediction is the output's first (target) tokens,
  so the flow-matching loss covers the target tokens only;
- given to Qwen2.5-VL with the instruction in the pipeline's edit template (its processor's image tokens
  inside the prompt), the first ``prompt_template_encode_start_idx`` (64) states dropped: the text
  (``QwenImageEditPipeline.encode_prompt``'s own method runs), which then includes the image's tokens.

Everything else (timestep, text mask, true CFG with the norm rescale, FSDP2 plan, LoRA targets, sequence plan) is
Qwen-Image's (:mod:`mindspeed_mm.models.qwen_image`): under sequence parallelism the joint sequence of target and
source tokens is split as one image stream (its rotary table is the two shapes' concatenated) and gathered
whole after ``proj_out``, before the target's tokens are kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mindspeed_mm.models.dit import DIT_FAMILIES, register_dit
from mindspeed_mm.models.encoders import encode_latents
from mindspeed_mm.models.flux import pack_latents, unpack_latents

#: Qwen-Image's text-to-image family, which this one extends.
QWEN_IMAGE = DIT_FAMILIES.get("QwenImageTransformer2DModel")

#: The pixel area ``QwenImageEditPipeline`` resizes the source image to (``calculate_dimensions(1024 * 1024, ratio)``).
CONDITION_AREA = 1024 * 1024

#: Text tokens the cache and sampler pad to: the edit prompt holds the source image's tokens too (a 1024 x 1024
#: image gives about 1,340 of them through Qwen2.5-VL's processor).
TEXT_LEN = 2048

#: ``model_index.json`` ``_class_name`` that selects this family.
PIPELINE = "QwenImageEditPipeline"


def condition_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` the pipeline resizes the PIL ``image`` to (about :data:`CONDITION_AREA` pixels)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(CONDITION_AREA, image.size[0] / image.size[1])
    return int(height), int(width)


def _resize(image: Any, vae_scale: int) -> tuple[Any, torch.Tensor]:
    """``(the resized PIL image the text encoder sees, its pixels [1, 3, h, w] in [-1, 1] the VAE encodes)``."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=vae_scale * 2)
    height, width = condition_size(image)
    resized = processor.resize(image, height, width)
    return resized, processor.preprocess(resized, height, width)


def _vae_scale(vae: Any) -> int:
    return 2 ** len(vae.config.temperal_downsample) if vae is not None else 8


@torch.no_grad()
def encode_edit_prompts(parts: dict[str, Any], captions: list[str], images: list[Any]) -> list[torch.Tensor]:
    """Each caption's real tokens ``[len_i, D]`` as ``QwenImageEditPipeline.encode_prompt`` encodes it with its
    (resized) source image: the pipeline's own method runs on ``parts`` (``text_encoder``, ``tokenizer``,
    ``processor``, ``vae`` for the resize's multiple).

    Raises:
        ValueError: no processor folder, or a caption without an image.
    """
    from diffusers import QwenImageEditPipeline

    if parts.get("processor") is None:
        raise ValueError("Qwen-Image-Edit encodes the prompt with the image: the pipeline needs its processor folder")
    if len(images) != len(captions):
        raise ValueError(f"{len(captions)} prompts but {len(images)} source images; give one image per prompt")
    encoder = parts["text_encoder"]
    pipe = QwenImageEditPipeline(
        scheduler=None,
        vae=None,
        text_encoder=encoder,
        tokenizer=parts["tokenizer"],
        processor=parts["processor"],
        transformer=None,
    )
    resized = [_resize(image, _vae_scale(parts.get("vae")))[0] for image in images]
    text, mask = pipe.encode_prompt(captions, image=resized, device=next(encoder.parameters()).device)
    lengths = mask.sum(dim=1).tolist() if mask is not None else [text.shape[1]] * len(captions)
    return [t[:n] for t, n in zip(text, lengths)]


def _encode(
    parts: dict[str, Any], captions: list[str], text_len: int, images: list[Any] | None = None
) -> tuple[torch.Tensor, None]:
    """The edit prompts' text zero-padded to ``text_len`` tokens ``[B, text_len, D]``.

    Raises:
        ValueError: no source image, or a prompt longer than ``text_len`` tokens.
    """
    if not images:
        raise ValueError("a Qwen-Image-Edit model encodes each prompt with its source image: give --image SRC")
    rows = encode_edit_prompts(parts, captions, images)
    longest = max(len(r) for r in rows)
    if longest > text_len:
        raise ValueError(
            f"an edit prompt with its image has {longest} tokens, more than the text length {text_len}; raise "
            f"data.text_len (--text-len) to at least {longest}"
        )
    return torch.stack([torch.cat([r, r.new_zeros(text_len - len(r), r.shape[-1])]) for r in rows]), None


@torch.no_grad()
def encode_source_image(parts: dict[str, Any], image: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    """``{"image_latents": [C, h, w]}``: the source image resized as the pipeline resizes it, through the VAE
    (posterior mode, ``(z - latents_mean) / latents_std``), as ``QwenImageEditPipeline._encode_vae_image``.
    The target's frames / height / width (the other arguments) do not change it."""
    vae = parts["vae"]
    _, pixels = _resize(image, _vae_scale(vae))
    return {"image_latents": encode_latents(vae, pixels.to(next(vae.parameters()).device, vae.dtype))[0]}


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
    image_latents: torch.Tensor | None = None,
) -> dict[str, Any]:
    if image_latents is None:
        raise ValueError(
            "a Qwen-Image-Edit transformer needs the source image's latents (image_latents): give --image SRC to "
            "generate, or `condition_image` in every data record for extract-features"
        )
    inputs = QWEN_IMAGE.model_inputs(config, noisy, sigmas, text, pooled, guidance)
    height, width = noisy.shape[-2:]
    source_height, source_width = image_latents.shape[-2:]
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], pack_latents(image_latents.to(noisy.dtype))], dim=1)
    shapes = [(1, height // 2, width // 2), (1, source_height // 2, source_width // 2)]
    inputs["img_shapes"] = [shapes] * noisy.shape[0]
    return inputs


def _prediction(output: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """The target's tokens (the first ``H/2 x W/2``) of the output, unpacked."""
    height, width = shape[-2], shape[-1]
    return unpack_latents(output[0][:, : (height // 2) * (width // 2)], height, width)


QWEN_IMAGE_EDIT = register_dit(
    dataclasses.replace(
        QWEN_IMAGE,
        variant="edit",
        select_variant=None,
        model_inputs=_inputs,
        prediction=_prediction,
        text_len=TEXT_LEN,
        encode_prompts=_encode,
        image_prompts=True,
        conditions=(("image_latents", lambda config: True),),
        image_conditions=encode_source_image,
        condition_folders=(("processor", lambda config: True),),
    )
)
