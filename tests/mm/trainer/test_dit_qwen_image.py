"""Qwen-Image (``QwenImageTransformer2DModel``) training against diffusers: loss and every gradient.

A training microbatch's loss and every parameter's gradient equal a reference computed with a
separately loaded diffusers model as ``train_dreambooth_lora_qwen_image.py`` writes it
(``(1 - sigma) x0 + sigma noise`` packed with ``QwenImagePipeline._pack_latents``, ``timestep`` =
``t / 1000``, ``img_shapes``, the texts of the microbatch zero-padded to the longest one with
``encoder_hidden_states_mask`` over their real tokens, the prediction unpacked, ``noise - x0``), on the
same latents, noise and timesteps, with logit-normal timesteps, sigma_sqrt weighting and text dropout
(the null text is the empty prompt's own, shorter embedding). The texts have 2-5 tokens, so the mask
is exercised; our trainer pads to ``data.text_len`` and cuts back. The timestep reaches the model in
float32 under bf16 (the model's forward casts it to its hidden states' dtype itself) and bf16's loss stays within 2% of fp32's.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.task import TASKS

QWEN_IMAGE = "QwenImageTransformer2DModel"
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


def _reference(model_dir, task, batch, own_grid: bool = False) -> tuple[float, dict[str, torch.Tensor], bool]:
    """Loss and gradients as diffusers' Qwen-Image training script computes them, with the task's draws (and, with
    ``own_grid``, the model given our grid's sigmas, which differ from the scheduler's ``t / 1000`` by up to an ulp)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    c = task.config.diffusion
    latents, noise = batch.latents, batch.draw.noise
    b, channels, height, width = latents.shape
    generator = task.flow.generator(task.config.train.seed, 0)
    u = compute_density_for_timestep_sampling(
        c.timestep_sampling, b, c.logit_mean, c.logit_std, c.mode_scale, generator=generator
    )
    indices = (u * 1000).long()
    assert torch.equal(indices, batch.draw.indices)
    assert torch.equal(torch.randn(latents.shape, generator=generator), noise)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=c.shift)
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices]
    s = sigmas.reshape(b, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    features, null, drop = task.features, task.features.null(), batch.draw.drop.tolist()
    texts = [null["text"] if d else features[i]["text"] for i, d in zip(batch.indices, drop)]
    longest = max(len(t) for t in texts)
    text = torch.stack([torch.cat([t, t.new_zeros(longest - len(t), t.shape[1])]) for t in texts])
    mask = torch.stack([torch.arange(longest) < len(t) for t in texts]).long()
    masked = not bool(mask.all())
    model = QwenImageTransformer2DModel.from_pretrained(model_dir)
    packed = QwenImagePipeline._pack_latents(noisy, b, channels, height, width)
    pred = model(
        hidden_states=packed,
        timestep=task.flow.sigmas[indices] if own_grid else timesteps / 1000,
        encoder_hidden_states=text,
        encoder_hidden_states_mask=mask if masked else None,
        img_shapes=[[(1, height // 2, width // 2)]] * b,
        return_dict=False,
    )[0]
    # _unpack_latents works in pixels (vae_scale_factor 8) and returns the one-frame 5-D latents
    pred = QwenImagePipeline._unpack_latents(pred, height * 8, width * 8, 8)[:, :, 0]
    weighting = compute_loss_weighting_for_sd3(c.loss_weighting, sigmas).reshape(b, 1, 1, 1)
    target = noise - latents
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}, masked


def _parity(run) -> dict:
    config = load_mm_config(
        None,
        _overrides(*run, **{"train.micro_batch_size": 3, "train.precision": "fp32"})
        + [f"diffusion.{k}={v}" for k, v in DIFFUSION.items()],
    )
    task = TASKS.get("dit")(config, 1)
    batch = task.microbatches(1, 0)[0]
    seen = {}
    task.model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    loss, _ = task.loss(batch, torch.zeros(2))
    loss.backward()
    ours = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in task.model.named_parameters()}
    expected, grads, masked = _reference(run[0], task, batch)
    _, same_grid, _ = _reference(run[0], task, batch, own_grid=True)
    grid_error = max(
        float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in same_grid.items() if g is not None
    )
    unused = sorted(n for n, g in grads.items() if g is None)  # the last block's text-stream output
    errors = {
        n: float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items() if g is not None
    }
    result = {
        "unused": unused,
        "ours_unused": sorted(n for n, g in ours.items() if g is None),
        "loss": float(loss.detach()),
        "expected": expected,
        "grad_error": max(errors.values()),
        "worst": max(errors, key=errors.get),
        "grid_error": grid_error,
        "names": set(ours) == set(grads),
        "nonzero": sum(bool(g.abs().max() > 0) for g in grads.values() if g is not None),
        "params": len(grads),
        "dropped": int(batch.draw.drop.sum()),
        "indices": batch.draw.indices.tolist(),
        "masked": masked,
        "our_mask": seen["encoder_hidden_states_mask"],
        "text_tokens": seen["encoder_hidden_states"].shape[1],
    }
    seen, losses = {}, []
    for precision in ("fp32", "bf16"):
        task = TASKS.get("dit")(
            load_mm_config(None, _overrides(*run, **{"train.precision": precision, "train.micro_batch_size": 2})), 1
        )
        if precision == "bf16":
            # after FSDP2's cast and the task's fp32 restore (the model itself then casts it to its
            # hidden states' dtype, as diffusers' forward does under bf16 in the pipeline too)
            task.model.register_forward_pre_hook(
                lambda m, args, kwargs: seen.update(timestep=kwargs["timestep"]), with_kwargs=True
            )
        batch = task.microbatches(1, 0)[0]
        loss = task.loss(batch, torch.zeros(2))[0]
        loss.backward()
        losses.append(float(loss))
        seen["grid"] = task.flow.sigmas[batch.draw.indices]
    result.update(bf16=losses, timestep=seen["timestep"], grid=seen["grid"])
    return result


def test_qwen_image_loss_and_gradients_equal_diffusers_reference(tmp_path) -> None:
    run = write_tiny_dit_run(tmp_path / "qwen-image", QWEN_IMAGE)
    result = launch(_parity, (run,))
    print(
        f"Qwen-Image {DIFFUSION}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative "
        f"gradient error {result['grad_error']:.1e} ({result['worst']}; with our grid's sigmas {result['grid_error']:.1e}) over {result['params']} parameters ({result['nonzero']} nonzero), "
        f"timesteps {result['indices']}, no gradient {result['unused']}, dropped {result['dropped']}, text tokens {result['text_tokens']}; "
        f"fp32/bf16 loss {result['bf16']}"
    )
    assert result["names"] and result["unused"] == result["ours_unused"]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
    # diffusers' t / 1000 differs from our grid's sigma by up to an ulp, which the time embedding's sinusoids
    # (scaled by 1000 inside the model) carry into its first linear's gradient; with our grid's sigmas every
    # gradient agrees to 1e-5
    assert result["grad_error"] < 5e-5
    assert result["grid_error"] < 1e-5
    assert result["nonzero"] > result["params"] // 2
    assert result["dropped"] > 0 and len(set(result["indices"])) == 3  # dropout exercised; per-sample timesteps
    assert result["masked"] and result["our_mask"] is not None  # texts of different lengths: the mask is used
    assert result["text_tokens"] < TEXT_LEN  # cut back to the longest real text
    assert result["timestep"].dtype == torch.float32 and torch.equal(result["timestep"], result["grid"])
    fp32, bf16 = result["bf16"]
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32
