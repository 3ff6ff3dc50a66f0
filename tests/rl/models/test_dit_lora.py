"""A LoRA policy (peft factors on the tiny Wan transformer, as ``mindspeed-mm train``'s ``lora`` puts them) against
the formulas.

- Only the factors train: the Flow-GRPO loss's gradient reaches the ``lora_A`` / ``lora_B`` parameters only, and
  there equals the hand-written formula's autograd gradient through a plain model whose linears compute
  ``W x + (alpha / r) B A x`` by hand (rel 1e-5), with the factors moved after sampling (so that ``A`` has a
  gradient, the ratios leave 1 and both clip branches act) and the KL to the reference on.
- The reference with the adapters off is the base model: its step means equal those of the base transformer
  (a copy taken before LoRA), and the adapters are on again afterwards (the trained means differ).
- A merged export (:func:`merged_transformer`, a plain ``WanTransformer3DModel``) saved and loaded by diffusers
  gives the LoRA model's velocity.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mindspeed_mm.models.wan import WAN
from mindspeed_rl.algorithms.advantages import compute_advantages
from mindspeed_rl.algorithms.flow_grpo import flow_grpo_loss, gaussian_kl, select_steps
from mindspeed_rl.algorithms.losses import policy_loss_config
from mindspeed_rl.models.dit_lora import (
    AdapterOffPolicy,
    adapter_state,
    apply_policy_lora,
    load_adapter_state,
    merged_transformer,
    policy_lora_config,
    trainable_parameters,
)
from mindspeed_rl.models.dit_policy import DiTPolicy, PromptBatch, schedule
from tests.rl.models.test_dit_policy_wan import BATCH, GUIDANCE, NOISE, SHAPE, STEPS, hand_log_prob, wan_scheduler

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def tiny() -> dict:
    torch.manual_seed(0)
    base = WAN.load_class()(**WAN.tiny_config).eval()
    model = copy.deepcopy(base)
    lora = policy_lora_config(RANK, ALPHA, ["default"])
    adapted = apply_policy_lora(model, WAN, lora)
    generator = torch.Generator().manual_seed(1)
    negative = torch.randn(1, 6, 16, generator=generator).expand(BATCH, -1, -1)
    prompts = PromptBatch(torch.randn(BATCH, 6, 16, generator=generator), None, negative, None)
    noise = torch.randn(BATCH, *SHAPE, generator=generator)
    return {"base": base, "model": model, "lora": lora, "adapted": adapted, "prompts": prompts, "noise": noise}


def lora_by_hand(base: torch.nn.Module, model: torch.nn.Module, adapted: list[str]) -> torch.nn.Module:
    """A copy of ``base`` whose adapted linears compute ``W x + b + (alpha / r) B (A x)`` with ``A``, ``B`` the
    LoRA model's factors as leaves of the copy (their gradients are compared)."""
    hand = copy.deepcopy(base)
    factors = dict(model.named_parameters())
    for name in adapted:
        linear = hand.get_submodule(name)
        a = torch.nn.Parameter(factors[f"{name}.lora_A.default.weight"].detach().clone())
        b = torch.nn.Parameter(factors[f"{name}.lora_B.default.weight"].detach().clone())
        linear.register_parameter("hand_a", a)
        linear.register_parameter("hand_b", b)
        linear.forward = lambda x, m=linear: (
            torch.nn.functional.linear(x, m.weight, m.bias) + ALPHA / RANK * (x @ m.hand_a.T) @ m.hand_b.T
        )
    return hand


def hand_mean_std(model, x, i, sigmas, timesteps, prompts):
    def call(text):
        t = timesteps[i].expand(x.shape[0])
        return model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    u, c = call(prompts.negative_text), call(prompts.text)
    v = u + GUIDANCE * (c - u)
    t, t_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = t_next - t
    sigma_t = NOISE * math.sqrt(t / (1 - (float(sigmas[1]) if t == 1 else t)))
    return x + (v + sigma_t**2 / (2 * t) * (x + (1 - t) * v)) * dt, sigma_t * math.sqrt(-dt)


def test_lora_policy_gradient_is_the_formulas_on_the_factors_only(tiny) -> None:
    base, model, prompts, noise = tiny["base"], copy.deepcopy(tiny["model"]), tiny["prompts"], tiny["noise"]
    trained = trainable_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert trained and all(".lora_A." in names[id(p)] or ".lora_B." in names[id(p)] for p in trained)
    assert len(trained) == 2 * len(tiny["adapted"]) == 2 * 4 * 2 * WAN.tiny_config["num_layers"]
    sigmas, timesteps = schedule(WAN, wan_scheduler(), STEPS, tuple(noise.shape))
    policy = DiTPolicy(model, WAN, noise_level=NOISE, guidance_scale=GUIDANCE)
    reference = AdapterOffPolicy(model, WAN, noise_level=NOISE, guidance_scale=GUIDANCE)
    trajectory = policy.sample(noise, prompts, sigmas, timesteps, torch.Generator().manual_seed(7))
    with torch.no_grad():  # the factors move after sampling (B starts at 0: A would have no gradient)
        generator = torch.Generator().manual_seed(3)
        for p in trained:
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    steps = select_steps(STEPS, 0.5, torch.Generator().manual_seed(5))
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75])
    advantages = compute_advantages("grpo", rewards, group_size=2)
    config = policy_loss_config("ppo_clip", kl_coef=0.0, clip_eps_low=0.005, clip_eps_high=0.005)
    log_probs, means, scales = policy.log_probs(trajectory, steps, prompts)
    with torch.no_grad():
        _, ref_means, _ = reference.log_probs(trajectory, steps, prompts)
    assert all(p.requires_grad for p in trained), "the reference left the factors frozen"
    kl = torch.stack([gaussian_kl(means[:, k], ref_means[:, k], scales[k]) for k in range(len(steps))], dim=1)
    out = flow_grpo_loss(log_probs, trajectory.log_probs[:, steps], advantages, config, kl=kl, kl_coef=0.3)
    out.loss.backward()
    assert 0 < float(out.metrics["pg_clipfrac"]) < 1 and float(out.metrics["kl"]) > 0
    assert all(p.grad is None for n, p in model.named_parameters() if n in base_before), "a base weight got a grad"

    # by hand: the base's linears plus (alpha / r) B A x; the reference is the base itself
    hand = lora_by_hand(base, model, tiny["adapted"])
    hand.requires_grad_(False)
    for name in tiny["adapted"]:
        hand.get_submodule(name).hand_a.requires_grad_(True)
        hand.get_submodule(name).hand_b.requires_grad_(True)
    groups = rewards.view(2, 2)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1)
    terms, kls = [], []
    for i in steps.tolist():
        mean, std = hand_mean_std(hand, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
        with torch.no_grad():
            ref_mean, _ = hand_mean_std(base, trajectory.latents[:, i], i, sigmas, timesteps, prompts)
        ratio = torch.exp(hand_log_prob(trajectory.latents[:, i + 1], mean, std) - trajectory.log_probs[:, i])
        terms.append(torch.maximum(-adv * ratio, -adv * ratio.clamp(0.995, 1.005)))
        kls.append(((mean - ref_mean) ** 2 / (2 * std**2)).reshape(BATCH, -1).mean(1))
    loss = torch.stack(terms).mean() + 0.3 * torch.stack(kls).mean()
    loss.backward()
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-5, atol=1e-7)
    factors = dict(model.named_parameters())
    for name in tiny["adapted"]:
        linear = hand.get_submodule(name)
        for which, expected in (("A", linear.hand_a.grad), ("B", linear.hand_b.grad)):
            got = factors[f"{name}.lora_{which}.default.weight"].grad
            scale = float(expected.abs().max())
            assert scale > 0, (name, which)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} {which}")

    # AdamW on the factors only: the base weights do not move
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    optimizer.step()
    for name, value in base_before.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name


def test_reference_is_the_base_and_the_merged_export_is_the_policy(tiny, tmp_path) -> None:
    base, model, prompts, noise = tiny["base"], copy.deepcopy(tiny["model"]), tiny["prompts"], tiny["noise"]
    with torch.no_grad():
        generator = torch.Generator().manual_seed(4)
        for p in trainable_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    timestep = torch.full((BATCH,), 700.0)
    lora_policy = DiTPolicy(model, WAN, guidance_scale=GUIDANCE)
    off = AdapterOffPolicy(model, WAN, guidance_scale=GUIDANCE)
    with torch.no_grad():
        v_base = DiTPolicy(base, WAN, guidance_scale=GUIDANCE).velocity(noise, timestep, prompts)
        v_off = off.velocity(noise, timestep, prompts)
        v_lora = lora_policy.velocity(noise, timestep, prompts)
    torch.testing.assert_close(v_off, v_base, rtol=0, atol=0)
    assert float((v_lora - v_base).abs().max()) > 1e-3  # the adapters are on again, and act

    merged = merged_transformer(model, WAN, tiny["lora"])
    merged.save_pretrained(str(tmp_path / "merged"))
    loaded = WAN.load_class().from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        v_merged = DiTPolicy(loaded, WAN, guidance_scale=GUIDANCE).velocity(noise, timestep, prompts)
    torch.testing.assert_close(v_merged, v_lora, rtol=1e-5, atol=1e-5)

    state = adapter_state(model)
    fresh = copy.deepcopy(tiny["model"])
    load_adapter_state(fresh, state)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="lora_target_modules"):
        load_adapter_state(fresh, {k: v for k, v in list(state.items())[1:]})
    with pytest.raises(ValueError, match="lora_rank"):
        policy_lora_config(0, ALPHA, ["default"])
    with pytest.raises(ValueError, match="lora_target_modules"):
        policy_lora_config(RANK, ALPHA, [])
