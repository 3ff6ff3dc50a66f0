"""What feature extraction computes: normalised VAE latents and text-encoder outputs, as the pipelines use them.

The cache (:mod:`mindspeed_mm.data.features`) holds exactly what training feeds the transformer:

- latents: the VAE posterior's mode (MindSpeed-MM's ``do_sample: false``), normalised as the
  pipeline un-normalises before decoding: per channel ``(z - latents_mean) / latents_std`` for
  Wan's VAE (MindSpeed-MM's ``channel_specified_shift_scale``), ``(z - shift_factor) x
  scaling_factor`` for FLUX's ``AutoencoderKL``;
- Wan text: UMT5's output for the caption's real tokens (``WanPipeline`` pads the rest with zeros,
  which the trainer does from ``data.text_len``);
- FLUX text: T5's output over all ``max_length`` tokens, padding included and no attention mask
  (as ``FluxPipeline``), and CLIP's pooled output over its tokenizer's ``model_max_length``.
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
    z = vae.encode(pixels).latent_dist.mode()
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
