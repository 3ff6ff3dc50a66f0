"""Wan2.2 TI2V-5B: one ``WanTransformer3DModel`` for text-to-video and image-to-video (the ``ti2v`` variant).

Its pipeline (``model_index.json``: ``expand_timesteps: true``) gives the transformer a timestep per
token (``[B, S]``) instead of one per sample. Without an image (``WanPipeline``) every token has the
step's ``t``. With one (``WanImageToVideoPipeline(image=...)``), the first latent frame of the model's
input is the image's normalised latents (the VAE's mode of the image alone, ``[C, 1, H, W]``) and its
tokens get timestep 0; the sampler's latents keep their own first frame, which is replaced by the
image's at the end. The transformer itself has as many input as output channels (48, the Wan2.2 VAE's
``z_dim``), so it is told from a text-to-video Wan by its pipeline's ``expand_timesteps`` only.

Training follows the same conditioning: with probability ``diffusion.first_frame_ratio`` a sample's
first latent frame is given clean (``x0``'s own first frame: the Wan VAE encodes the first frame of a
video alone, so it is the image's latents) at timestep 0, and its loss is the mean over the other
frames (the sampler never uses the first frame's prediction). The other samples train text-to-video.
Everything else is Wan's (:mod:`mindspeed_mm.models.wan`); under sequence parallelism the per-token
timesteps are split as the tokens are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mindspeed_mm.models.dit import DIT_FAMILIES, register_dit
from mindspeed_mm.models.dit_parallel import SequencePlan, Split
from mindspeed_mm.models.encoders import encode_first_frame

#: Wan's text-to-video family, which this one extends.
WAN = DIT_FAMILIES.get("WanTransformer3DModel")


def token_timesteps(
    config: Any, timestep: torch.Tensor, shape: tuple[int, ...], first_frame: torch.Tensor | None
) -> torch.Tensor:
    """``[B, S]``: each token's timestep, ``timestep [B]`` everywhere but 0 on the first latent frame's tokens
    of the samples with ``first_frame`` (``WanImageToVideoPipeline``'s ``first_frame_mask x t``)."""
    p_t, p_h, p_w = config["patch_size"]
    frames, per_frame = shape[2] // p_t, (shape[3] // p_h) * (shape[4] // p_w)
    mask = torch.ones(shape[0], frames, per_frame, dtype=timestep.dtype, device=timestep.device)
    if first_frame is not None:
        mask[first_frame.to(mask.device).bool(), 0] = 0.0
    return (mask * timestep.reshape(-1, 1, 1)).flatten(1)


def condition_input(noisy: torch.Tensor, image_latents: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
    """``noisy`` with its first latent frame replaced by ``image_latents`` ``[B, C, 1, H, W]`` where ``first_frame``."""
    keep = first_frame.to(noisy.device).bool().reshape(-1, 1, 1, 1, 1)
    head = torch.where(keep, image_latents.to(noisy.dtype), noisy[:, :, :1])
    return torch.cat([head, noisy[:, :, 1:]], dim=2)


def _inputs(
    config: Any,
    noisy: torch.Tensor,
    sigmas: torch.Tensor,
    text: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: float,
    image_latents: torch.Tensor | None = None,
    first_frame: torch.Tensor | None = None,
) -> dict[str, Any]:
    if image_latents is not None and first_frame is None:
        first_frame = torch.ones(noisy.shape[0], dtype=torch.bool)
    if image_latents is not None:
        noisy = condition_input(noisy, image_latents, first_frame)
    inputs = WAN.model_inputs(config, noisy, sigmas, text, pooled, guidance)
    inputs["timestep"] = token_timesteps(config, inputs["timestep"], tuple(noisy.shape), first_frame)
    return inputs


def _image_conditions(parts: dict[str, Any], image: Any, num_frames: int, height: int, width: int) -> dict:
    """The image's latents alone (``[C, 1, H', W']``), as ``WanImageToVideoPipeline`` with ``expand_timesteps``
    encodes it (no image encoder)."""
    return {"image_latents": encode_first_frame({"vae": parts["vae"]}, image, 1, height, width)["image_latents"]}


WAN_TI2V = register_dit(
    dataclasses.replace(
        WAN,
        variant="ti2v",
        select_variant=None,
        model_inputs=_inputs,
        # Wan2.2 TI2V-5B: as many input as output channels (the Wan2.2 VAE's 48; 4 in the tiny model)
        tiny_config=dict(WAN.tiny_config),
        image_conditions=_image_conditions,
        first_frame_condition=True,
        timestep_tokens=token_timesteps,
        # Wan's plan, and the per-token timesteps split as the video tokens (diffusers' _cp_plan splits them too)
        sequence_plan=SequencePlan(
            splits=(*WAN.sequence_plan.splits, Split("", "timestep", 1, ndim=2)),
            gather=WAN.sequence_plan.gather,
            cross_attention_local=True,
        ),
    )
)
