"""A fixed, lossless "VAE" for the embedded demo: pixels folded into channels (space-to-depth), nothing learned.

``encode`` turns ``[B, 3, (F,) H, W]`` pixels in [-1, 1] into ``[B, 3 p^2, (F,) H/p, W/p]`` latents
(each ``p x p`` patch's pixels become channels); ``decode`` is the exact inverse. Why the demo uses
it rather than a tiny ``AutoencoderKLWan``: a VAE that reconstructs coloured shapes needs training
of its own before the transformer can learn anything, more than the demo's minutes on two cores
allow, and a half-trained one would blur exactly what the learning check measures. With this one
every colour and motion in a sample comes from the diffusion transformer. It has the interface the
suite uses of diffusers' VAEs (``encode(x).latent_dist.mode()``, ``decode(z, return_dict=False)``,
``latents_mean`` / ``latents_std`` and ``scale_factor_spatial`` in its config, which the image-to-video
conditions read) and saves and loads as a diffusers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin


@dataclass
class _Point:
    """A posterior that is one point (``mode()`` and ``sample()`` are the latents)."""

    latents: torch.Tensor

    def mode(self) -> torch.Tensor:
        return self.latents

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latents


@dataclass
class PatchEncoding:
    """``encode``'s output, shaped as diffusers' ``AutoencoderKLOutput``."""

    latent_dist: _Point


class PatchVAE(ModelMixin, ConfigMixin):
    """Space-to-depth with patch ``patch_size``: ``3 p^2`` latent channels, ``p`` times smaller in space, same frames."""

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 3,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
        scale_factor_spatial: int | None = None,  # always patch_size: taken so that a saved config loads as saved
    ) -> None:
        super().__init__()
        channels = in_channels * patch_size * patch_size
        self.register_to_config(
            latents_mean=list(latents_mean or [0.0] * channels),
            latents_std=list(latents_std or [1.0] * channels),
            scale_factor_spatial=patch_size,  # as AutoencoderKLWan's: what the pipelines' VideoProcessor resizes by
        )
        # ModelMixin wants a parameter to tell the device and dtype; it is never used.
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    @property
    def latent_channels(self) -> int:
        """Channels of the latents."""
        return self.config.in_channels * self.config.patch_size**2

    def encode(self, pixels: torch.Tensor, return_dict: bool = True) -> PatchEncoding | tuple[_Point]:
        """``[B, C, (F,) H, W] -> [B, C p^2, (F,) H/p, W/p]``."""
        p = self.config.patch_size
        video = pixels.ndim == 5
        x = pixels if video else pixels.unsqueeze(2)
        b, c, f, h, w = x.shape
        if h % p or w % p:
            raise ValueError(f"PatchVAE: height {h} and width {w} must be multiples of its patch size {p}")
        z = (
            x.reshape(b, c, f, h // p, p, w // p, p)
            .permute(0, 1, 4, 6, 2, 3, 5)
            .reshape(b, c * p * p, f, h // p, w // p)
        )
        z = z if video else z.squeeze(2)
        return PatchEncoding(_Point(z)) if return_dict else (_Point(z),)

    def decode(self, latents: torch.Tensor, return_dict: bool = True) -> tuple[torch.Tensor] | dict[str, torch.Tensor]:
        """The inverse of :meth:`encode`."""
        p = self.config.patch_size
        video = latents.ndim == 5
        z = latents if video else latents.unsqueeze(2)
        b, cpp, f, h, w = z.shape
        c = cpp // (p * p)
        x = z.reshape(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 2, 6, 3).reshape(b, c, f, h * p, w * p)
        x = x if video else x.squeeze(2)
        return {"sample": x} if return_dict else (x,)
