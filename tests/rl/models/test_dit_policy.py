"""Flow-GRPO on a tiny FLUX transformer (diffusers' ``FluxTransformer2DModel``, built in code) against the formulas.

- With noise level 0 the SDE sampler is ``mindspeed_mm``'s ODE sampler (diffusers' Euler scheduler, FLUX's
  sigmas and ``mu``), guided and unguided.
- Each recorded step's log-probability equals a re-computation written here from the Flow-GRPO formula
  (mean ``x + [v + s^2/(2t)(x + (1 - t) v)] dt``, std ``a sqrt(t/(1-t)) sqrt(-dt)``, ``torch.distributions.Normal``)
  through the diffusers transformer called with diffusers' own packing and ids.
- The loss (clipped objective on a random half of the steps, GRPO advantages of 2 groups of 2, KL of the
  step means to the reference) and its gradient w.r.t. every transformer parameter equal the hand-written
  formula's autograd gradient (rel 1e-5), with the weights moved after sampling so the ratios are off 1
  and some are clipped.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from mindspeed_mm.diffusion.sampler import build_scheduler, sample_latents
from mindspeed_mm.models.flux import FLUX
from mindspeed_rl.algorithms.flow_grpo import flow_grpo_loss, gaussian_kl, per_prompt_advantages, select_steps
from mindspeed_rl.algorithms.losses import policy_loss_config
from mindspeed_rl.models.dit_policy import DiTPolicy, PromptBatch, schedule

STEPS, BATCH, SHAPE, NOISE, GUIDANCE = 4, 4, (4, 4, 4), 0.7, 3.0


@pytest.fixture(scope="module")
def tiny() -> dict:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX.tiny_config).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = PromptBatch(
        torch.randn(BATCH, 3, 32, generator=generator),
        torch.randn(BATCH, 32, generator=generator),
        torch.randn(1, 3, 32, generator=generator).expand(BATCH, -1, -1),
        torch.randn(1, 32, generator=generator).expand(BATCH, -1),
    )
    noise = torch.randn(BATCH, *SHAPE, generator=generator)
    return {"model": model, "prompts": prompts, "noise": noise}


def hand_velocity(model, x: torch.Tensor, t: torch.Tensor, prompts: PromptBatch, guidance: float) -> torch.Tensor:
    """FluxPipeline's transformer call, written with its own packing helpers."""
    b, c, h, w = x.shape

    def call(text, pooled):
        out = model(
            hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=(t / 1000).expand(b),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype),
            txt_ids=torch.zeros(text.shape[1], 3),
            guidance=torch.ones(b),
            return_dict=False,
        )[0]
        return FluxPipeline._unpack_latents(out, h, w, 1)

    v = call(prompts.text, prompts.pooled)
    if guidance > 1:
        u = call(prompts.negative_text, prompts.negative_pooled)
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


def test_noise_level_zero_is_the_ode_sampler(tiny) -> None:
    model, prompts, noise = tiny["model"], tiny["prompts"], tiny["noise"]
    scheduler = build_scheduler(FLUX)
    sigmas, timesteps = schedule(FLUX, scheduler, STEPS, tuple(noise.shape))
    for guidance in (1.0, GUIDANCE):
        policy = DiTPolicy(model, FLUX, noise_level=0.0, guidance_scale=guidance)
        ours = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator()).latents[:, -1]
        ode = sample_latents(
            model, FLUX, build_scheduler(FLUX), noise, prompts.text, STEPS, prompts.pooled,
            prompts.negative_text, prompts.negative_pooled, guidance,
        )  # fmt: skip
        torch.testing.assert_close(ours, ode, rtol=1e-6, atol=1e-6)


def test_recorded_log_probs_and_the_loss_gradient_equal_the_formulas(tiny) -> None:
    model, prompts, noise = copy.deepcopy(tiny["model"]), tiny["prompts"], tiny["noise"]
    sigmas, timesteps = schedule(FLUX, build_scheduler(FLUX), STEPS, tuple(noise.shape))
    policy = DiTPolicy(model, FLUX, noise_level=NOISE, guidance_scale=GUIDANCE)
    trajectory = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator().manual_seed(7))
    assert trajectory.latents.shape == (BATCH, STEPS + 1, *SHAPE) and trajectory.log_probs.shape == (BATCH, STEPS)

    with torch.no_grad():
        for i in range(STEPS):
            mean, std = hand_step(model, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
            expected = hand_log_prob(trajectory.latents[:, i + 1], mean, std)
            torch.testing.assert_close(trajectory.log_probs[:, i], expected, rtol=1e-6, atol=1e-6)
            # the sampled step is that Gaussian's: its standardised noise is a standard normal draw
            z = (trajectory.latents[:, i + 1] - mean) / std
            assert abs(float(z.mean())) < 0.5 and 0.6 < float(z.std()) < 1.4

    # the update: the weights move after sampling (so the ratios leave 1), the reference stays
    reference = DiTPolicy(copy.deepcopy(model), FLUX, noise_level=NOISE, guidance_scale=GUIDANCE)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75])
    config = policy_loss_config("ppo_clip", kl_coef=0.0, clip_eps_low=0.02, clip_eps_high=0.02)
    steps = select_steps(STEPS, 0.5, torch.Generator().manual_seed(5))
    assert len(steps) == 2

    from mindspeed_rl.algorithms.advantages import compute_advantages

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

    # by hand
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
    for name, p in model.named_parameters():
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name)
    assert float(out.metrics["kl"]) > 0


@pytest.mark.parametrize("window", [(0, 2), (1, 3)])
def test_sde_window_steps_are_ode_outside_and_their_log_probs_recompute(tiny, window) -> None:
    """Flow-GRPO-Fast / MixGRPO: SDE steps only in ``[start, end)``; the others are the ODE's (our ODE sampler's
    Euler steps, from the same latents) and record no log-probability; the window's recorded log-probs equal the
    paper's formula and :meth:`DiTPolicy.log_probs`' re-computation."""
    model, prompts, noise = tiny["model"], tiny["prompts"], tiny["noise"]
    sigmas, timesteps = schedule(FLUX, build_scheduler(FLUX), STEPS, tuple(noise.shape))
    policy = DiTPolicy(model, FLUX, noise_level=NOISE, guidance_scale=GUIDANCE)
    ode = DiTPolicy(model, FLUX, noise_level=0.0, guidance_scale=GUIDANCE)
    sde_steps = torch.arange(*window)
    trajectory = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator().manual_seed(7), sde_steps=sde_steps)
    reference = ode.sample(noise, prompts, sigmas, timesteps, torch.Generator()).latents
    start, end = window
    # before the window: exactly the ODE sampler's trajectory (itself = sample_latents, test above)
    torch.testing.assert_close(trajectory.latents[:, : start + 1], reference[:, : start + 1], rtol=0, atol=0)
    # after the window: the ODE sampler continued from where the window left the latents
    if end < STEPS:
        rest = ode.sample(trajectory.latents[:, end], prompts, sigmas[end:], timesteps[end:], torch.Generator())
        torch.testing.assert_close(trajectory.latents[:, end:], rest.latents, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        for i in range(STEPS):
            if start <= i < end:
                mean, std = hand_step(model, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
                expected = hand_log_prob(trajectory.latents[:, i + 1], mean, std)
                torch.testing.assert_close(trajectory.log_probs[:, i], expected, rtol=1e-6, atol=1e-6)
                assert not torch.allclose(trajectory.latents[:, i + 1], reference[:, i + 1], atol=1e-3), "no noise"
            else:
                assert trajectory.log_probs[:, i].abs().max() == 0
        recomputed, _, _ = policy.log_probs(trajectory, sde_steps, prompts)
    torch.testing.assert_close(recomputed, trajectory.log_probs[:, start:end], rtol=1e-6, atol=1e-6)


def test_step_selection() -> None:
    drawn = select_steps(10, 0.3, torch.Generator().manual_seed(0))
    assert len(drawn) == 3 and bool((drawn[1:] > drawn[:-1]).all()) and int(drawn.max()) < 10
    assert select_steps(10, 0.3, torch.Generator(), how="first").tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="timestep_fraction"):
        select_steps(10, 0.0, torch.Generator())


def test_per_prompt_stat_tracking() -> None:
    """Flow-GRPO's per-prompt advantages by hand: prompt mean, population std of the round (or the prompt) + 1e-4."""
    prompts = ["a", "b", "a", "c", "b", "a", "c", "c"]
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 4.0, 4.0])
    values = rewards.tolist()
    mean_all = sum(values) / len(values)
    std_all = (sum((v - mean_all) ** 2 for v in values) / len(values)) ** 0.5 + 1e-4
    means = {p: sum(v for q, v in zip(prompts, values) if q == p) / prompts.count(p) for p in "abc"}
    stds = {
        p: (sum((v - means[p]) ** 2 for q, v in zip(prompts, values) if q == p) / prompts.count(p)) ** 0.5 + 1e-4
        for p in "abc"
    }
    expected_global = [(v - means[p]) / std_all for p, v in zip(prompts, values)]
    expected_local = [(v - means[p]) / stds[p] for p, v in zip(prompts, values)]
    torch.testing.assert_close(per_prompt_advantages(rewards, prompts), torch.tensor(expected_global))
    torch.testing.assert_close(per_prompt_advantages(rewards, prompts, global_std=False), torch.tensor(expected_local))
    assert per_prompt_advantages(rewards, prompts)[[3, 6, 7]].tolist() == [0.0, 0.0, 0.0]  # prompt c: all equal
    assert per_prompt_advantages(torch.ones(4), ["a", "a", "b", "b"]).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="one prompt a reward"):
        per_prompt_advantages(rewards, prompts[:3])
