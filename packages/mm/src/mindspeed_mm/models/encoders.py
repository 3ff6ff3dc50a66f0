"""What feature extraction computes: normalised VAE latents and text-encoder outputs, as the pipelines use them.

The cache (:mod:`mindspeed_mm.data.features`) holds exactly what training feeds the transformer:

- latents: the VAE posterior's mode (MindSpeed-MM's ``do_sample: false``), normalised as the
  pipeline un-normalises before decoding: per channel ``(z - latents_mean) / latents_std`` for
  Wan's VAE (MindSpeed-MM's ``channel_specified_shift_scale``), ``(z - shift_factor) x
  scaling_factor`` for FLUX's ``AutoencoderKL``;
- Wan text: UMT5's output for the caption's real tokens (``WanPipeline`` pads the rest with zeros,
  which the trainer does from ``data.text_len``);
- FLUX text: T5's output over all ``max_length`` tokens, padding included and no attention mask
  (as ``FluxPipeline``), and CLIP's pooled output over its tokenizer's ``model_max_length``;
- SD3 text: two CLIPs' penultimate hidden states (padded to T5's width) then T5's output, and the
  two CLIPs' pooled outputs concatenated (as ``StableDiffusion3Pipeline``);
- Qwen-Image text: Qwen2.5-VL's last hidden state of the caption's real tokens after the template's
  (``QwenImagePipeline.encode_prompt``; the trainer pads with zeros and masks them).

A causal 3-D VAE (Wan's, Qwen-Image's ``AutoencoderKLQwenImage``: a ``temperal_downsample`` in its
config) takes an image ``[B, 3, H, W]`` as a one-frame video; its latents lose the frame axis again.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean


@torch.no_grad()
def encode_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents of ``pixels`` in [-1, 1] (``[B, 3, F, H, W]`` video or ``[B, 3, H, W]`` image).

    Raises:
        ValueError: a VAE whose config has neither ``latents_mean``/``latents_std`` nor ``scaling_factor``.
    """
    frames = pixels.ndim == 4 and getattr(vae.config, "temperal_downsample", None) is not None
    z = vae.encode(pixels[:, :, None] if frames else pixels).latent_dist.mode()
    z = z[:, :, 0] if frames else z
    config = vae.config
    if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
        shape = (1, -1) + (1,) * (z.ndim - 2)
        mean = torch.tensor(config.latents_mean, dtype=z.dtype, device=z.device).view(shape)
        std = torch.tensor(config.latents_std, dtype=z.dtype, device=z.device).view(shape)
        return (z - mean) / std
    if getattr(config, "scaling_factor", None) is None:
        raise ValueError(
            f"{type(vae).__name__}: its config has neither latents_mean/latents_std nor scaling_factor; "
            "give a diffusers VAE directory"
        )
    return (z - (getattr(config, "shift_factor", None) or 0.0)) * config.scaling_factor


@torch.no_grad()
def encode_umt5(tokenizer: Any, encoder: Any, captions: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """UMT5's last hidden state for each caption's real tokens (``[len_i, D]``), as ``WanPipeline`` encodes them
    (its own caption cleaning, padding to ``max_length``, truncation)."""
    inputs = tokenizer(
        [prompt_clean(c) for c in captions],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    device = next(encoder.parameters()).device
    mask = inputs.attention_mask
    hidden = encoder(inputs.input_ids.to(device), mask.to(device)).last_hidden_state
    return [h[:n] for h, n in zip(hidden, mask.gt(0).sum(dim=1).tolist())]


@torch.no_grad()
def encode_t5_clip(
    clip_tokenizer: Any, clip: Any, t5_tokenizer: Any, t5: Any, captions: list[str], max_length: int = 512
) -> list[dict[str, torch.Tensor]]:
    """Per caption ``{"text": [max_length, D], "pooled": [P]}`` as ``FluxPipeline.encode_prompt`` computes them."""
    clip_inputs = clip_tokenizer(
        captions, padding="max_length", max_length=clip_tokenizer.model_max_length, truncation=True, return_tensors="pt"
    )
    pooled = clip(clip_inputs.input_ids.to(next(clip.parameters()).device), output_hidden_states=False).pooler_output
    t5_inputs = t5_tokenizer(
        captions, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    )
    text = t5(t5_inputs.input_ids.to(next(t5.parameters()).device), output_hidden_states=False)[0]
    return [{"text": t, "pooled": p} for t, p in zip(text, pooled)]


@torch.no_grad()
def encode_sd3(
    clip_tokenizer: Any,
    clip: Any,
    clip_tokenizer_2: Any,
    clip_2: Any,
    t5_tokenizer: Any,
    t5: Any,
    captions: list[str],
    max_length: int = 333,
    *,
    clip_skip: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per caption ``{"text": [max_length, D], "pooled": [P1 + P2]}`` as ``StableDiffusion3Pipeline.encode_prompt``
    computes them: each CLIP's penultimate hidden states over its ``model_max_length`` tokens (with
    ``clip_skip``, the pipeline's: ``clip_skip`` layers before the penultimate), the two concatenated on
    features and zero-padded to T5's width ``D``, then T5's output over the remaining
    ``max_length - model_max_length`` tokens (its ``max_sequence_length``) on the sequence; pooled: the
    two CLIPs' projected outputs concatenated.

    Raises:
        ValueError: ``max_length`` leaves no T5 token beside the CLIP tokens; ``clip_skip`` outside the CLIPs' layers.
    """
    clip_len = clip_tokenizer.model_max_length
    t5_len = max_length - clip_len
    if t5_len < 1:
        raise ValueError(
            f"text length {max_length} leaves no T5 token beside CLIP's {clip_len}; set data.text_len "
            f"(--text-len) to {clip_len} + T5's tokens (SD3's pipeline: {clip_len} + 256)"
        )
    skip = clip_skip or 0
    layers = min(clip.config.num_hidden_layers, clip_2.config.num_hidden_layers)
    if not 0 <= skip < layers:
        raise ValueError(f"--clip-skip {clip_skip}: the CLIP encoders have {layers} layers; give 0 to {layers - 1}")
    hidden, pooled = [], []
    for tokenizer, encoder in ((clip_tokenizer, clip), (clip_tokenizer_2, clip_2)):
        ids = tokenizer(captions, padding="max_length", max_length=clip_len, truncation=True, return_tensors="pt")
        out = encoder(ids.input_ids.to(next(encoder.parameters()).device), output_hidden_states=True)
        pooled.append(out[0])
        hidden.append(out.hidden_states[-(skip + 2)])
    t5_ids = t5_tokenizer(
        captions, padding="max_length", max_length=t5_len, truncation=True, add_special_tokens=True, return_tensors="pt"
    )
    t5_text = t5(t5_ids.input_ids.to(next(t5.parameters()).device))[0]
    clip_text = torch.cat(hidden, dim=-1)
    clip_text = torch.nn.functional.pad(clip_text, (0, t5_text.shape[-1] - clip_text.shape[-1]))
    text = torch.cat([clip_text.to(t5_text.device, t5_text.dtype), t5_text], dim=-2)
    pooled = torch.cat(pooled, dim=-1)
    return [{"text": t, "pooled": p} for t, p in zip(text, pooled)]


@torch.no_grad()
def encode_qwen_image(
    tokenizer: Any, encoder: Any, captions: list[str], max_length: int = 512
) -> list[dict[str, torch.Tensor]]:
    """Per caption ``{"text": [len_i, D]}``: ``QwenImagePipeline.encode_prompt``'s embeddings of its real tokens.

    The pipeline's own method runs (its prompt template, the dropped template tokens, Qwen2.5-VL's last
    hidden state, truncation to ``max_length``); each caption keeps the rows its mask marks real.
    """
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=encoder, tokenizer=tokenizer, transformer=None)
    text, mask = pipe.encode_prompt(captions, device=next(encoder.parameters()).device, max_sequence_length=max_length)
    lengths = mask.sum(dim=1).tolist() if mask is not None else [text.shape[1]] * len(captions)
    return [{"text": t[:n]} for t, n in zip(text, lengths)]


def _first_frame_video(image: torch.Tensor, num_frames: int, last: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 3, num_frames, H, W]``: the image ``[B, 3, H, W]`` as the first frame, zeros after it (and ``last``
    as the last frame)."""
    if last is None:
        rest = image.new_zeros(image.shape[0], image.shape[1], num_frames - 1, *image.shape[2:])
        return torch.cat([image[:, :, None], rest], dim=2)
    rest = image.new_zeros(image.shape[0], image.shape[1], num_frames - 2, *image.shape[2:])
    return torch.cat([image[:, :, None], rest, last[:, :, None]], dim=2)


@torch.no_grad()
def encode_first_frame(
    parts: dict[str, Any], image: Any, num_frames: int, height: int, width: int, last_image: Any = None
) -> dict[str, torch.Tensor]:
    """The image-to-video conditions of one image, as ``WanImageToVideoPipeline`` computes them.

    ``image_latents`` ``[C, F, H', W']``: the VAE's posterior mode of the video ``[image, zeros x
    (num_frames - 1)]`` (the image resized by diffusers' ``VideoProcessor``), normalised with the
    pipeline's arithmetic ``(z - latents_mean) x (1 / latents_std)``; ``image_embeds`` ``[N, D]`` (when
    ``parts`` has an ``image_encoder``): the CLIP vision model's penultimate hidden states of the image
    through the pipeline's ``image_processor``.

    With ``last_image`` (first-last-frame to video, ``WanImageToVideoPipeline(last_image=...)``): the video is
    ``[image, zeros x (num_frames - 2), last_image]`` and ``image_embeds`` ``[2 N, D]`` the two images' hidden
    states, the first image's tokens first.

    Args:
        parts: the pipeline's ``vae`` and, for Wan2.1 I2V, ``image_encoder`` and ``image_processor``.
        image: a PIL image.
        last_image: the last frame's PIL image (FLF2V), or None.
    """
    from diffusers.video_processor import VideoProcessor

    vae = parts["vae"]
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    pixels = processor.preprocess(image, height=height, width=width)
    last = None if last_image is None else processor.preprocess(last_image, height=height, width=width)
    device = next(vae.parameters()).device
    last = None if last is None else last.to(torch.float32)
    video = _first_frame_video(pixels.to(torch.float32), num_frames, last).to(device, vae.dtype)
    z = vae.encode(video).latent_dist.mode().float()
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
    out = {"image_latents": ((z - mean) * inverse_std)[0]}
    if parts.get("image_encoder") is not None:
        encoder = parts["image_encoder"]
        weight = next(encoder.parameters())
        images = image if last_image is None else [image, last_image]
        inputs = parts["image_processor"](images=images, return_tensors="pt").to(weight.device, weight.dtype)
        out["image_embeds"] = encoder(**inputs, output_hidden_states=True).hidden_states[-2].flatten(0, 1)
    return out


def first_frame_image(pixels: torch.Tensor, index: int = 0) -> Any:
    """The first (or ``index``) frame of ``pixels`` ``[3, F, H, W]`` in [-1, 1] as an 8-bit PIL image (what the
    pipeline takes)."""
    from PIL import Image

    frame = ((pixels[:, index].float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(frame.permute(1, 2, 0).cpu().numpy())
