"""A diffusion transformer as a policy: SDE trajectories that record each step's log-probability, and their
re-computation with gradients (Flow-GRPO / DanceGRPO, :mod:`mindspeed_rl.algorithms.flow_grpo`).

The transformer is a ``mindspeed_mm`` diffusion family's diffusers class (FLUX, Wan: any
:class:`~mindspeed_mm.models.dit.DiTFamily`), called through the family's ``model_inputs`` /
``prediction`` as ``mindspeed_mm``'s sampler calls it, on the schedule of the pipeline's diffusers
scheduler (:func:`schedule`: its sigmas and timesteps for ``steps`` steps, FLUX's ``mu`` included). With
classifier-free guidance (``guidance_scale > 1`` and negative text) the velocity is
``uncond + g (cond - uncond)``, both from the policy, in sampling and in training alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_mm.models.dit import DiTFamily
from mindspeed_rl.algorithms.flow_grpo import gaussian_log_prob, sde_noise_scale, sde_step_mean


@dataclass
class PromptBatch:
    """The text of a batch of samples: ``text [B, L, D]``, ``pooled [B, P]`` (FLUX) and the negative text's."""

    text: torch.Tensor
    pooled: torch.Tensor | None = None
    negative_text: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> PromptBatch:
        """The batch's rows ``index``."""

        def pick(value: torch.Tensor | None) -> torch.Tensor | None:
            return None if value is None else value[index]

        return PromptBatch(pick(self.text), pick(self.pooled), pick(self.negative_text), pick(self.negative_pooled))


@dataclass
class Trajectory:
    """SDE samples of a batch.

    Attributes:
        latents: ``[B, S + 1, ...]``: the noise, then the latents after each of the ``S`` steps.
        log_probs: ``[B, S]``: each step's log-probability as recorded (0 with noise level 0).
        sigmas: ``[S + 1]`` the schedule (float32, descending to 0); ``timesteps`` ``[S]`` what the model saw.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor


def schedule(
    family: DiTFamily, scheduler: Any, steps: int, latent_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas [S + 1], timesteps [S])`` of the diffusers ``scheduler`` for ``steps`` steps (as the pipelines set it)."""
    scheduler.set_timesteps(steps, device="cpu", **family.timestep_kwargs(scheduler.config, steps, latent_shape))
    return scheduler.sigmas.float().cpu(), scheduler.timesteps.float().cpu()


class DiTPolicy:
    """The velocity of a diffusers transformer (with guidance) and the SDE steps of :mod:`~mindspeed_rl.algorithms.flow_grpo`.

    Args:
        model: the diffusers transformer (trained in place).
        family: its ``mindspeed_mm`` family.
        noise_level: Flow-GRPO's ``a`` (0.7 in the paper; 0: the ODE, no log-probabilities).
        guidance_scale: classifier-free guidance (``> 1`` with negative text).
        distilled_guidance: the guidance value of a guidance-distilled model (FLUX.1-dev).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        family: DiTFamily,
        noise_level: float = 0.7,
        guidance_scale: float = 1.0,
        distilled_guidance: float = 1.0,
    ) -> None:
        if noise_level < 0:
            raise ValueError(f"noise_level={noise_level} must be >= 0 (Flow-GRPO uses 0.7)")
        self.model, self.family = model, family
        self.noise_level, self.guidance_scale, self.distilled_guidance = noise_level, guidance_scale, distilled_guidance

    def _call(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor | None):
        dtype = next(self.model.parameters()).dtype
        pooled = pooled.to(dtype) if pooled is not None else None
        inputs = self.family.model_inputs(
            self.model.config, latents.to(dtype), timestep, text.to(dtype), pooled, self.distilled_guidance
        )
        inputs["timestep"] = timestep
        return self.family.prediction(self.model(**inputs), tuple(latents.shape))

    def velocity(self, latents: torch.Tensor, timestep: torch.Tensor, prompts: PromptBatch) -> torch.Tensor:
        """The (guided) velocity at ``latents`` ``[B, ...]`` and model timestep ``[B]``."""
        velocity = self._call(latents, timestep, prompts.text, prompts.pooled)
        if self.guidance_scale > 1.0 and prompts.negative_text is not None:
            uncond = self._call(latents, timestep, prompts.negative_text, prompts.negative_pooled)
            velocity = uncond + self.guidance_scale * (velocity - uncond)
        return velocity

    def step(
        self,
        latents: torch.Tensor,
        index: int,
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        prompts: PromptBatch,
        stochastic: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, noise scale)`` of SDE step ``index`` from ``latents`` (``[B, ...]``, ``[]``); with
        ``stochastic=False`` the ODE's (Euler) step and a scale of 0."""
        batch = latents.shape[0]
        timestep = timesteps[index].expand(batch).to(latents.device) / self.family.timestep_divisor
        velocity = self.velocity(latents, timestep, prompts)
        sigma, sigma_next = sigmas[index], sigmas[index + 1]
        noise_level = self.noise_level if stochastic else 0.0
        scale = sde_noise_scale(sigma, sigma_next, float(sigmas[1]), noise_level)
        mean = sde_step_mean(
            latents, velocity, sigma.to(latents.device), sigma_next.to(latents.device), scale.to(latents.device)
        )
        return mean, scale.to(latents.device)

    @torch.no_grad()
    def sample(
        self,
        noise: torch.Tensor,
        prompts: PromptBatch,
        sigmas: torch.Tensor,
        timesteps: torch.Tensor,
        generator: torch.Generator,
        sde_steps: torch.Tensor | None = None,
    ) -> Trajectory:
        """Denoise ``noise`` ``[B, ...]`` along the SDE, drawing each step's noise from ``generator`` (on the CPU).

        Each step's log-probability is recorded as :meth:`log_probs` re-computes it. ``sde_steps``: only these
        step indices are SDE steps, the others the ODE's (Euler, log-probability 0, no draw): Flow-GRPO-Fast's
        and MixGRPO's window. None: every step (the default).
        """
        latents = noise.float()
        states, log_probs = [latents], []
        stochastic = set(range(len(timesteps)) if sde_steps is None else sde_steps.tolist())
        for index in range(len(timesteps)):
            sde = index in stochastic
            mean, scale = self.step(latents, index, sigmas, timesteps, prompts, stochastic=sde)
            if self.noise_level > 0 and sde:
                eps = torch.randn(latents.shape, generator=generator).to(latents.device)
                latents = mean + scale * eps
                log_probs.append(gaussian_log_prob(latents, mean, scale))
            else:
                latents = mean
                log_probs.append(torch.zeros(latents.shape[0], device=latents.device))
            states.append(latents)
        return Trajectory(torch.stack(states, dim=1), torch.stack(log_probs, dim=1), sigmas, timesteps)

    def log_probs(
        self, trajectory: Trajectory, steps: torch.Tensor, prompts: PromptBatch, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_probs [B, K], means [B, K, ...], scales [K])`` of the recorded ``steps`` under the current weights.

        Args:
            trajectory: recorded samples.
            steps: ``[K]`` step indices.
            prompts: the text of the rows (``rows`` of the trajectory).
            rows: which rows of the trajectory (default all).

        Raises:
            ValueError: with noise level 0 (an ODE step has no density).
        """
        if self.noise_level <= 0:
            raise ValueError("noise_level=0 is the ODE sampler: its steps have no log-probability; use e.g. 0.7")
        latents = trajectory.latents if rows is None else trajectory.latents[rows]
        out, means, scales = [], [], []
        for index in steps.tolist():
            mean, scale = self.step(latents[:, index], index, trajectory.sigmas, trajectory.timesteps, prompts)
            out.append(gaussian_log_prob(latents[:, index + 1], mean, scale))
            means.append(mean)
            scales.append(scale)
        return torch.stack(out, dim=1), torch.stack(means, dim=1), torch.stack(scales)
