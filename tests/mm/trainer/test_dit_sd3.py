"""SD3 (``SD3Transformer2DModel``) training against diffusers: loss and every gradient.

A training microbatch's loss and every parameter's gradient equal a reference computed with a
separately loaded diffusers model as ``train_dreambooth_sd3.py`` writes it (the scheduler's
``scale_noise``, the latents as they are, ``timestep`` = the scheduler's timesteps, the pooled
projections, zero-padded text, ``noise - x0``), on the same latents, noise and timesteps, with
logit-normal timesteps, sigma_sqrt weighting and text dropout; the timestep reaches the model in
float32 under bf16 and bf16's loss stays within 2% of fp32's. Both for SD3's blocks and SD3.5's (an image-only
second attention in the first block, RMS-normed queries and keys).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.models.dit import write_tiny_dit
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.task import TASKS

SD3 = "SD3Transformer2DModel"
TEXT_LEN = 8
DIFFUSION = {"shift": 3.0, "timestep_sampling": "logit_normal", "loss_weighting": "sigma_sqrt", "text_dropout": 0.5}


def _overrides(model_dir, features, **extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        f"data.text_len={TEXT_LEN}",
        "data.shuffle=false",
        "logging.progress=false",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def _reference(model_dir, task, batch, own_grid: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients as diffusers' SD3 training script computes them, with the task's draws (and, with
    ``own_grid``, the model given our grid's timesteps, which differ from the scheduler's by up to an ulp)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    c = task.config.diffusion
    latents, noise = batch.latents, batch.draw.noise
    b = latents.shape[0]
    generator = task.flow.generator(task.config.train.seed, 0)
    u = compute_density_for_timestep_sampling(
        c.timestep_sampling, b, c.logit_mean, c.logit_std, c.mode_scale, generator=generator
    )
    indices = (u * 1000).long()
    assert torch.equal(indices, batch.draw.indices)
    assert torch.equal(torch.randn(latents.shape, generator=generator), noise)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices]
    noisy = scheduler.scale_noise(latents, timesteps, noise)
    if own_grid:
        timesteps = task.flow.timesteps[indices]
    features, null, drop = task.features, task.features.null(), batch.draw.drop.tolist()

    def pad(u):
        return torch.cat([u, u.new_zeros(TEXT_LEN - u.size(0), u.size(1))])

    text = torch.stack([pad(null["text"]) if d else pad(features[i]["text"]) for i, d in zip(batch.indices, drop)])
    pooled = torch.stack([null["pooled"] if d else features[i]["pooled"] for i, d in zip(batch.indices, drop)])
    model = SD3Transformer2DModel.from_pretrained(model_dir)
    pred = model(
        hidden_states=noisy,
        timestep=timesteps,
        encoder_hidden_states=text,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    weighting = compute_loss_weighting_for_sd3(c.loss_weighting, sigmas).reshape(b, 1, 1, 1)
    target = noise - latents
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


def _parity(run) -> dict:
    config = load_mm_config(
        None,
        _overrides(*run, **{"train.micro_batch_size": 3, "train.precision": "fp32"})
        + [f"diffusion.{k}={v}" for k, v in DIFFUSION.items()],
    )
    task = TASKS.get("dit")(config, 1)
    batch = task.microbatches(1, 0)[0]
    loss, _ = task.loss(batch, torch.zeros(2))
    loss.backward()
    ours = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in task.model.named_parameters()}
    expected, grads = _reference(run[0], task, batch)
    errors = {n: float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items()}
    _, same_grid = _reference(run[0], task, batch, own_grid=True)
    grid_error = max(float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in same_grid.items())
    result = {
        "loss": float(loss.detach()),
        "expected": expected,
        "grad_error": max(errors.values()),
        "grid_error": grid_error,
        "names": set(ours) == set(grads),
        "nonzero": sum(bool(g.abs().max() > 0) for g in grads.values()),
        "params": len(grads),
        "dropped": int(batch.draw.drop.sum()),
        "indices": batch.draw.indices.tolist(),
    }
    seen, losses = {}, []
    for precision in ("fp32", "bf16"):
        task = TASKS.get("dit")(
            load_mm_config(None, _overrides(*run, **{"train.precision": precision, "train.micro_batch_size": 2})), 1
        )
        if precision == "bf16":
            task.model.time_text_embed.register_forward_pre_hook(lambda m, args: seen.update(timestep=args[0]))
        batch = task.microbatches(1, 0)[0]
        loss = task.loss(batch, torch.zeros(2))[0]
        loss.backward()
        losses.append(float(loss))
        seen["grid"] = task.flow.timesteps[batch.draw.indices]
    result.update(bf16=losses, timestep=seen["timestep"], grid=seen["grid"])
    return result


@pytest.mark.parametrize(
    "variant", [{}, {"dual_attention_layers": (0,), "qk_norm": "rms_norm"}], ids=["sd3", "sd3.5-dual-attention"]
)
def test_sd3_loss_and_gradients_equal_diffusers_reference(tmp_path, variant) -> None:
    run = write_tiny_dit_run(tmp_path / "sd3", SD3)
    write_tiny_dit(run[0], SD3, **variant)  # SD3.5's blocks: an image-only second attention, RMS-normed q/k
    result = launch(_parity, (run,))
    print(
        f"SD3 {variant} {DIFFUSION}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative gradient "
        f"error {result['grad_error']:.1e} (with our grid's timesteps {result['grid_error']:.1e}) over {result['params']} parameters ({result['nonzero']} nonzero), "
        f"timesteps {result['indices']}, dropped {result['dropped']}; fp32/bf16 loss {result['bf16']}"
    )
    assert result["names"]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
    # diffusers' timesteps differ from our grid's by up to an ulp (6e-5 at t ~ 550), which the time
    # embedding's sinusoids carry into its first linear's gradient (2e-5 relative); with our grid's
    # timesteps every gradient agrees to 1e-5
    assert result["grad_error"] < 5e-5
    assert result["grid_error"] < 1e-5
    assert result["nonzero"] > result["params"] // 2
    assert result["dropped"] > 0 and len(set(result["indices"])) == 3  # dropout exercised; per-sample timesteps
    assert result["timestep"].dtype == torch.float32 and torch.equal(result["timestep"], result["grid"])
    fp32, bf16 = result["bf16"]
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32
