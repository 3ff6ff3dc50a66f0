"""Rectified-flow training as diffusers' flow-matching scheduler and MindSpeed-MM's Wan scheduler define it.

A sample is ``x_t = (1 - s) x0 + s noise`` at noise level ``s`` (sigma); the model predicts the
velocity ``noise - x0``. Noise levels come from a fixed grid (:func:`sigma_grid`, equal to the
training sigmas of diffusers' ``FlowMatchEulerDiscreteScheduler`` and MindSpeed-MM's
``WanFlowMatchScheduler``), indexed by a number ``u`` in [0, 1) drawn from a density
(:func:`sample_density`, as diffusers' ``compute_density_for_timestep_sampling``). The model is
given ``timestep = s x num_train_timesteps``.

Every draw of a microbatch (``u``, the noise, the text dropout) comes from one generator seeded by
``(seed, global microbatch number)``, so the draws are a function of the step and the sample
order alone: one rank accumulating two microbatches sees the draws two ranks see, and a resumed
run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mindspeed_mm.config import DiffusionConfig


def sigma_grid(num_train_timesteps: int, shift: float) -> torch.Tensor:
    """The ``num_train_timesteps`` training sigmas, from 1 down to ``1 / N``, shifted (float32, descending)."""
    base = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float64) / num_train_timesteps
    return (shift * base / (1 + (shift - 1) * base)).float()


def sample_density(
    scheme: str,
    size: int,
    generator: torch.Generator,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """``size`` numbers in [0, 1] drawn from ``scheme`` (``uniform``, ``logit_normal``, ``mode``) with ``generator``.

    The same draws as diffusers' ``compute_density_for_timestep_sampling`` given the same generator.
    """
    if scheme == "logit_normal":
        return torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(size,), generator=generator))
    u = torch.rand(size, generator=generator)
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if scheme != "uniform":
        raise ValueError(f"diffusion.timestep_sampling={scheme!r} is unknown; use uniform, logit_normal or mode")
    return u


@dataclass
class FlowDraw:
    """The random draws of one microbatch.

    Attributes:
        indices: grid index of each sample ``[B]`` (int64; 0 is pure noise).
        noise: standard normal noise shaped as the latents ``[B, ...]``.
        drop: whether each sample's text is replaced by the empty caption's ``[B]`` (bool).
        first_frame: whether each sample's first latent frame is given clean ``[B]`` (bool; Wan2.2 TI2V,
            ``first_frame_ratio``; drawn last, so the draws before it do not depend on it).
    """

    indices: torch.Tensor
    noise: torch.Tensor
    drop: torch.Tensor
    first_frame: torch.Tensor | None = None


class FlowMatching:
    """The grid, the draws, the noising and the loss weights of one ``diffusion`` config."""

    def __init__(self, config: DiffusionConfig) -> None:
        self.config = config
        self.sigmas = sigma_grid(config.num_train_timesteps, config.shift)
        self.timesteps = self.sigmas * config.num_train_timesteps
        # MindSpeed-MM's (DiffSynth's) "bsmntw": a Gaussian bump over the grid's timesteps, min 0, mean 1.
        n = config.num_train_timesteps
        bump = torch.exp(-2 * ((self.timesteps - n / 2) / n) ** 2)
        bump = bump - bump.min()
        self.bsmntw = bump * (n / bump.sum())
        #: grid indices ``[lo, hi)`` the draws are confined to (an expert's range), None: the whole grid.
        self.index_range: tuple[int, int] | None = None

    def expert_range(self, expert: str, boundary_ratio: float) -> tuple[int, int]:
        """The grid indices ``[lo, hi)`` of a Wan2.2 expert: ``high_noise`` the timesteps ``t >= boundary``,
        ``low_noise`` those below (``WanPipeline``'s switch, ``boundary = boundary_ratio x N``)."""
        n = self.config.num_train_timesteps
        high = int((self.timesteps >= boundary_ratio * n).sum())  # the grid descends: the first `high` indices
        lo, hi = (0, high) if expert == "high_noise" else (high, n)
        if lo >= hi:
            raise ValueError(
                f"diffusion.boundary_ratio={boundary_ratio} leaves the {expert} expert no timestep of the grid "
                f"(shift {self.config.shift}); give a ratio inside the grid's timesteps"
            )
        return lo, hi

    def generator(self, seed: int, microbatch: int) -> torch.Generator:
        """The generator of global microbatch ``microbatch`` (counting from 0 over the whole run)."""
        return torch.Generator().manual_seed(seed * 1_000_003 + microbatch)

    def draw(self, generator: torch.Generator, latent_shape: tuple[int, ...]) -> FlowDraw:
        """Draw ``u`` (one per sample or per microbatch), then the noise, then the text dropout."""
        c = self.config
        batch = latent_shape[0]
        u = sample_density(
            c.timestep_sampling,
            batch if c.timestep_per == "sample" else 1,
            generator,
            c.logit_mean,
            c.logit_std,
            c.mode_scale,
        )
        if self.index_range is not None:  # an expert's range of the grid
            lo, hi = self.index_range
            indices = (lo + (u * (hi - lo)).long().clamp(0, hi - lo - 1)).expand(batch).clone()
        else:
            u = c.min_timestep_boundary + u * (c.max_timestep_boundary - c.min_timestep_boundary)
            indices = (u * c.num_train_timesteps).long().clamp(0, c.num_train_timesteps - 1).expand(batch).clone()
        noise = torch.randn(latent_shape, generator=generator)
        drop = torch.rand(batch, generator=generator) < c.text_dropout
        first_frame = torch.rand(batch, generator=generator) < c.first_frame_ratio
        return FlowDraw(indices, noise, drop, first_frame)

    def noisy(self, latents: torch.Tensor, noise: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``x_t = (1 - s) x0 + s noise`` at the sigmas of ``indices``."""
        sigma = self._per_sample(self.sigmas[indices.cpu()], latents)
        return (1 - sigma) * latents + sigma * noise

    def loss(
        self,
        prediction: torch.Tensor,
        latents: torch.Tensor,
        noise: torch.Tensor,
        indices: torch.Tensor,
        skip_first_frame: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per sample: the mean over its elements of ``weight x (prediction - (noise - x0))^2`` (float32) ``[B]``;
        over the frames after the first for the samples of ``skip_first_frame`` ``[B]`` (given that frame)."""
        target = (noise - latents).float()
        error = (prediction.float() - target) ** 2
        per_sample = error.reshape(error.shape[0], -1).mean(dim=1)
        if skip_first_frame is not None and bool(skip_first_frame.any()):
            rest = error[:, :, 1:].reshape(error.shape[0], -1).mean(dim=1)
            per_sample = torch.where(skip_first_frame.to(per_sample.device).bool(), rest, per_sample)
        return per_sample * self.weights(indices).to(per_sample.device)

    def weights(self, indices: torch.Tensor) -> torch.Tensor:
        """The loss weight of each sample ``[B]`` under ``loss_weighting``."""
        scheme = self.config.loss_weighting
        indices = indices.cpu()
        sigmas = self.sigmas[indices]
        if scheme == "sigma_sqrt":
            return sigmas**-2.0
        if scheme == "cosmap":
            return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
        if scheme == "bsmntw":
            return self.bsmntw[indices]
        return torch.ones_like(sigmas)

    @staticmethod
    def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return values.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))
