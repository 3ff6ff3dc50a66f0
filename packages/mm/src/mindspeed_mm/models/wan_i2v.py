"""Wan image-to-video: diffusers' ``WanTransformer3DModel`` in its I2V configuration (the ``i2v`` variant).

As ``WanImageToVideoPipeline`` conditions it, the transformer's input is the noisy latents
concatenated on channels with the mask over the latent frames (1 on the first, 0 after it; one
channel per frame the VAE folds into a latent frame, so ``in_channels - 2 C`` of them) and the
normalised latents of the video ``[first frame, zeros ...]`` (``image_latents``); Wan2.1 I2V
(``image_dim`` in the config) also takes the CLIP vision encoder's penultimate hidden states of the
first frame (``image_embeds``) as ``encoder_hidden_states_image``. Wan2.1 FLF2V (the ``flf2v`` variant:
``pos_embed_seq_len`` in the config) gives the last frame too: the video ``[first, zeros ..., last]``, the mask
also on the last frame, and both frames' features. Both are computed per sample by
:func:`~mindspeed_mm.models.encoders.encode_first_frame` and cached by ``extract-features``; the
mask is built from the latents' shape. Everything else (timestep, text, FSDP2 plan, sequence
parallelism, LoRA targets) is Wan's (:mod:`mindspeed_mm.models.wan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mindspeed_mm.models.dit import DIT_FAMILIES, register_dit
from mindspeed_mm.models.encoders import encode_first_frame

#: Wan's text-to-video family, which this one extends.
WAN = DIT_FAMILIES.get("WanTransformer3DModel")

#: The text length Wan2.1 I2V's attention processor assumes (it takes the tokens before the last 512 as the image's).
IMAGE_TEXT_LEN = 512


def first_frame_mask(config: Any, noisy: torch.Tensor, image_latents: torch.Tensor, last: bool = False) -> torch.Tensor:
    """``[B, M, F, H, W]``: 1 over the first latent frame, 0 elsewhere (``M = in_channels - 2 C``); with ``last``
    (FLF2V) also 1 on the last latent frame's last channel: the mask is one channel per video frame the VAE folds
    into a latent frame, and only the video's last frame of that latent frame is given.

    Raises:
        ValueError: a configuration with no channel left for the mask.
    """
    channels = config["in_channels"] - noisy.shape[1] - image_latents.shape[1]
    if channels < 1:
        raise ValueError(
            f"in_channels={config['in_channels']} leaves no mask channel beside {noisy.shape[1]} noisy and "
            f"{image_latents.shape[1]} image latent channels; give a Wan I2V transformer (in_channels = 2 C + 4)"
        )
    mask = image_latents.new_zeros(image_latents.shape[0], channels, *image_latents.shape[2:])
    mask[:, :, 0] = 1.0
    if last:
        mask[:, -1, -1] = 1.0
    return mask


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
    image_latents: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
) -> dict[str, Any]:
    if image_latents is None:
        raise ValueError("a Wan I2V transformer needs the first frame's latents (image_latents); give an image")
    last = config.get("pos_embed_seq_len") is not None  # FLF2V
    mask = first_frame_mask(config, noisy, image_latents, last)
    condition = torch.cat([mask, image_latents], dim=1).to(noisy.dtype)
    inputs = WAN.model_inputs(config, torch.cat([noisy, condition], dim=1), sigmas, text, pooled, guidance)
    if config.get("image_dim") is not None:
        if image_embeds is None:
            raise ValueError(
                "a Wan2.1 I2V transformer (image_dim set) needs the image encoder's features (image_embeds)"
            )
        if text.shape[1] != IMAGE_TEXT_LEN:
            raise ValueError(
                f"text of {text.shape[1]} tokens: Wan2.1 I2V's attention takes the last {IMAGE_TEXT_LEN} tokens "
                f"of its context as the text; set data.text_len (--text-len) to {IMAGE_TEXT_LEN}"
            )
        if last:  # the pipeline's [first, last] rows of N tokens each, per sample (the model views them as 2 N)
            image_embeds = image_embeds.reshape(image_embeds.shape[0] * 2, -1, image_embeds.shape[-1])
        inputs["encoder_hidden_states_image"] = image_embeds.to(noisy.dtype)
    return inputs


def _takes_image_embeds(config: Any) -> bool:
    return config.get("image_dim") is not None


WAN_I2V = register_dit(
    dataclasses.replace(
        WAN,
        variant="i2v",
        select_variant=None,
        model_inputs=_inputs,
        # diffusers' Wan tiny configuration with the I2V input (4 noisy + 4 mask + 4 image latent channels)
        # and a CLIP image embedding of 16 features projected into the blocks' cross-attention.
        tiny_config={**WAN.tiny_config, "in_channels": 12, "image_dim": 16, "added_kv_proj_dim": 24},
        conditions=(("image_latents", lambda config: True), ("image_embeds", _takes_image_embeds)),
        image_conditions=encode_first_frame,
        condition_folders=(("image_encoder", _takes_image_embeds), ("image_processor", _takes_image_embeds)),
    )
)


def _encode_first_last(
    parts: dict[str, Any], image: Any, num_frames: int, height: int, width: int, last_image: Any = None
) -> dict[str, torch.Tensor]:
    if last_image is None:
        raise ValueError("a Wan FLF2V transformer needs the last frame too; give --last-image FILE")
    return encode_first_frame(parts, image, num_frames, height, width, last_image)


#: Wan2.1 FLF2V (first-last-frame to video): the I2V input with the last frame given too, and both frames'
#: CLIP features (``pos_embed_seq_len = 2 N`` position embeddings over them), as ``WanImageToVideoPipeline(image=...,
#: last_image=...)`` conditions it.
WAN_FLF2V = register_dit(
    dataclasses.replace(
        WAN_I2V,
        variant="flf2v",
        # two images of the tiny CLIP's 17 tokens (2 x 2 patches of 8 in 32 x 32, and the class token)
        tiny_config={**WAN_I2V.tiny_config, "pos_embed_seq_len": 34},
        image_conditions=_encode_first_last,
        last_frame=True,
    )
)
