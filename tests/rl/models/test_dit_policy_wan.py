"""Flow-GRPO on a tiny Wan transformer (diffusers' ``WanTransformer3DModel``, built in code; video latents
``[B, C, F, H, W]``) against the formulas and ``WanPipeline``.

- With noise level 0 the SDE sampler is ``mindspeed_mm``'s ODE sampler and diffusers' ``WanPipeline`` (its
  Euler scheduler with Wan's flow shift 3, ``prompt_embeds`` / ``negative_prompt_embeds`` / ``latents``, guidance
  ``uncond + g (cond - uncond)``), guided and unguided.
- Each recorded step's log-probability equals a re-computation written here from the Flow-GRPO formula through
  the transformer called as ``WanPipeline`` calls it (``hidden_states``, ``timestep`` = the scheduler's ``t``,
  ``encoder_hidden_states``) and ``torch.distributions.Normal``.
- The loss (clipped objective on a random half of the steps, GRPO advantages of 2 groups of 2, KL to the
  reference) and its gradient w.r.t. every transformer parameter equal the hand-written formula's (rel 1e-5),
  with the weights moved after sampling so that the ratios leave 1 and both clip branches act.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mindspeed_mm.diffusion.sampler import build_scheduler, sample_latents
from mindspeed_mm.models.wan import WAN
from mindspeed_rl.algorithms.advantages import compute_advantages
from mindspeed_rl.algorithms.flow_grpo import flow_grpo_loss, gaussian_kl, select_steps
from mindspeed_rl.algorithms.losses import policy_loss_config
from mindspeed_rl.models.dit_policy import DiTPolicy, PromptBatch, schedule

STEPS, BATCH, SHAPE, NOISE, GUIDANCE, SHIFT = 4, 4, (4, 2, 4, 4), 0.7, 3.0, 3.0


def wan_scheduler():
    """Euler with Wan's flow shift (``build_scheduler(WAN, sampler='euler')`` keeps the family's 3.0)."""
    scheduler = build_scheduler(WAN, sampler="euler")
    assert scheduler.config.shift == SHIFT
    return scheduler


@pytest.fixture(scope="module")
def tiny() -> dict:
    torch.manual_seed(0)
    model = WAN.load_class()(**WAN.tiny_config).eval()
    generator = torch.Generator().manual_seed(1)
    negative = torch.randn(1, 6, 16, generator=generator).expand(BATCH, -1, -1)
    prompts = PromptBatch(torch.randn(BATCH, 6, 16, generator=generator), None, negative, None)
    noise = torch.randn(BATCH, *SHAPE, generator=generator)
    return {"model": model, "prompts": prompts, "noise": noise}


def hand_velocity(model, x: torch.Tensor, t: torch.Tensor, prompts: PromptBatch, guidance: float) -> torch.Tensor:
    """``WanPipeline``'s transformer call and guidance."""

    def call(text):
        return model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=text, return_dict=False)[0]

    v = call(prompts.text)
    if guidance > 1:
        u = call(prompts.negative_text)
        v = u + guidance * (v - u)
    return v


def hand_step(model, x, i, sigmas, timesteps, prompts):
    """Flow-GRPO's ``sde_step_with_logprob`` mean and std, as its paper writes them."""
    v = hand_velocity(model, x, timesteps[i], prompts, GUIDANCE)
    t, t_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = t_next - t
    sigma_t = NOISE * math.sqrt(t / (1 - (float(sigmas[1]) if t == 1 else t)))
    mean = x + (v + sigma_t**2 / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, sigma_t * math.sqrt(-dt)


def hand_log_prob(sample, mean, std):
    return torch.distributions.Normal(mean, std).log_prob(sample).reshape(sample.shape[0], -1).mean(1)


def test_noise_level_zero_is_the_ode_sampler_and_wan_pipeline(tiny) -> None:
    from diffusers import WanPipeline

    model, prompts, noise = tiny["model"], tiny["prompts"], tiny["noise"]
    sigmas, timesteps = schedule(WAN, wan_scheduler(), STEPS, tuple(noise.shape))
    # Wan's shift: s -> 3 s / (1 + 2 s) on Euler's grid from 1 to its (shifted) 1/1000 floor
    floor = SHIFT * 1e-3 / (1 + (SHIFT - 1) * 1e-3)
    grid = 1 - (1 - floor) / (STEPS - 1)
    assert abs(float(sigmas[1]) - SHIFT * grid / (1 + (SHIFT - 1) * grid)) < 1e-5
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=wan_scheduler(), transformer=model)
    for guidance in (1.0, GUIDANCE):
        policy = DiTPolicy(model, WAN, noise_level=0.0, guidance_scale=guidance)
        ours = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator()).latents[:, -1]
        ode = sample_latents(
            model, WAN, wan_scheduler(), noise, prompts.text, STEPS,
            negative_text=prompts.negative_text, guidance_scale=guidance,
        )  # fmt: skip
        torch.testing.assert_close(ours, ode, rtol=1e-6, atol=1e-6)
        theirs = pipe(
            prompt_embeds=prompts.text,
            negative_prompt_embeds=prompts.negative_text,
            latents=noise.clone(),
            height=SHAPE[2] * 8,
            width=SHAPE[3] * 8,
            num_frames=(SHAPE[1] - 1) * 4 + 1,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            output_type="latent",
        ).frames
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        assert float((ours - noise).abs().mean()) > 0.1  # it moved


def test_recorded_log_probs_and_the_loss_gradient_equal_the_formulas(tiny) -> None:
    model, prompts, noise = copy.deepcopy(tiny["model"]), tiny["prompts"], tiny["noise"]
    sigmas, timesteps = schedule(WAN, wan_scheduler(), STEPS, tuple(noise.shape))
    policy = DiTPolicy(model, WAN, noise_level=NOISE, guidance_scale=GUIDANCE)
    trajectory = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator().manual_seed(7))
    assert trajectory.latents.shape == (BATCH, STEPS + 1, *SHAPE) and trajectory.log_probs.shape == (BATCH, STEPS)

    with torch.no_grad():
        for i in range(STEPS):
            mean, std = hand_step(model, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
            expected = hand_log_prob(trajectory.latents[:, i + 1], mean, std)
            torch.testing.assert_close(trajectory.log_probs[:, i], expected, rtol=1e-6, atol=1e-6)
            z = (trajectory.latents[:, i + 1] - mean) / std
            assert abs(float(z.mean())) < 0.2 and 0.8 < float(z.std()) < 1.2
            wrong = hand_log_prob(trajectory.latents[:, i + 1], mean * 1.005, std)  # the check can fail
            assert not torch.allclose(trajectory.log_probs[:, i], wrong, rtol=1e-6, atol=1e-6)

    reference = DiTPolicy(copy.deepcopy(model), WAN, noise_level=NOISE, guidance_scale=GUIDANCE)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75])
    config = policy_loss_config("ppo_clip", kl_coef=0.0, clip_eps_low=0.02, clip_eps_high=0.02)
    steps = select_steps(STEPS, 0.5, torch.Generator().manual_seed(5))
    advantages = compute_advantages("grpo", rewards, group_size=2)
    log_probs, means, scales = policy.log_probs(trajectory, steps, prompts)
    with torch.no_grad():
        _, ref_means, _ = reference.log_probs(trajectory, steps, prompts)
    kl = torch.stack([gaussian_kl(means[:, k], ref_means[:, k], scales[k]) for k in range(len(steps))], dim=1)
    out = flow_grpo_loss(log_probs, trajectory.log_probs[:, steps], advantages, config, kl=kl, kl_coef=0.3)
    model.zero_grad()
    out.loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert 0 < float(out.metrics["pg_clipfrac"]) < 1, "both branches of the clip must be exercised"

    model.zero_grad()
    groups = rewards.view(2, 2)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
    terms, kls = [], []
    for i in steps.tolist():
        mean, std = hand_step(model, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
        with torch.no_grad():
            ref_mean, _ = hand_step(reference.model, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
        ratio = torch.exp(hand_log_prob(trajectory.latents[:, i + 1], mean, std) - trajectory.log_probs[:, i])
        terms.append(torch.maximum(-adv * ratio, -adv * ratio.clamp(0.98, 1.02)))
        kls.append(((mean - ref_mean) ** 2 / (2 * std**2)).reshape(BATCH, -1).mean(1))
    loss = torch.stack(terms).mean() + 0.3 * torch.stack(kls).mean()
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-5, atol=1e-7)
    moved = 0
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name)
        moved += scale > 0
    assert moved > len(ours) // 2 and float(out.metrics["kl"]) > 0
