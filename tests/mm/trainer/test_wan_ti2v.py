"""Wan2.2 TI2V-5B training (the ``WanTransformer3DModel:ti2v`` family) against diffusers.

- A transformer whose pipeline's ``model_index.json`` says ``expand_timesteps`` is the ``ti2v`` variant
  (the same class and channels as text-to-video).
- A training microbatch's loss and every parameter's gradient equal a reference computed with a
  separately loaded diffusers ``WanTransformer3DModel`` called as the pipelines call it: a timestep per
  token (``[B, S]``); for the samples trained image-to-video, the model input is
  ``WanImageToVideoPipeline``'s ``(1 - first_frame_mask) x condition + first_frame_mask x latents``
  (the condition: the sample's clean first latent frame) and their timestep ``first_frame_mask x t``
  (0 on the first frame's tokens), their loss the mean over the other frames; text-to-video samples
  as ``WanPipeline(expand_timesteps=True)``. Mixed (``first_frame_ratio`` 0.5), none and all.
"""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.models.dit import dit_family_of
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.task import TASKS

TI2V = "WanTransformer3DModel:ti2v"


@pytest.fixture(scope="module")
def ti2v_run(tmp_path_factory):
    """A tiny TI2V pipeline's transformer (``model_index.json`` with ``expand_timesteps``) and a feature cache."""
    root = tmp_path_factory.mktemp("wan-ti2v")
    model, features = write_tiny_dit_run(root, TI2V, num_samples=6)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": True}))
    return model, features


def _overrides(model_dir, features, **extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        "data.shuffle=false",
        "train.precision=fp32",
        "logging.progress=false",
        "diffusion.shift=5.0",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def _reference(task, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of a diffusers model given what the pipelines give it (see the module doc)."""
    from diffusers import WanTransformer3DModel

    indices, latents, noise = batch.draw.indices, batch.latents, batch.draw.noise
    sigmas = task.flow.sigmas[indices]
    shaped = sigmas.reshape(-1, 1, 1, 1, 1)
    noisy = (1.0 - shaped) * latents + shaped * noise
    text, _ = task.model_text(batch)
    model = WanTransformer3DModel.from_pretrained(task.source)
    first = batch.draw.first_frame
    mask = torch.ones(latents.shape[0], 1, *latents.shape[2:])  # the pipeline's first_frame_mask, per sample
    mask[first, :, 0] = 0.0
    inputs = (1 - mask) * latents[:, :, :1] + mask * noisy  # WanImageToVideoPipeline (expand_timesteps)
    timestep = torch.stack([(mask[b, 0][:, ::2, ::2] * t).flatten() for b, t in enumerate(sigmas * 1000.0)])
    pred = model(hidden_states=inputs, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    error = (pred.float() - (noise - latents).float()) ** 2
    per_sample = [(e[:, 1:] if f else e).mean() for e, f in zip(error, first.tolist())]
    loss = torch.stack(per_sample).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _parity(model_dir, features) -> dict:
    results = {}
    cases = (
        ("mixed", {"diffusion.first_frame_ratio": 0.5, "diffusion.text_dropout": 0.3}),
        ("text-to-video", {"diffusion.first_frame_ratio": 0.0}),
        ("image-to-video", {"diffusion.first_frame_ratio": 1.0, "diffusion.timestep_sampling": "logit_normal"}),
    )
    for name, extra in cases:
        config = load_mm_config(None, _overrides(model_dir, features, **{"train.micro_batch_size": 4, **extra}))
        task = TASKS.get("dit")(config, 1)
        batch = task.microbatches(1, 0)[0]
        seen = {}
        task.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(timestep=kwargs["timestep"].clone()), with_kwargs=True
        )
        loss, _ = task.loss(batch, torch.zeros(2))
        loss.backward()
        ours = {n: p.grad for n, p in task.model.named_parameters()}
        expected, grads = _reference(task, batch)
        results[name] = {
            "family": task.family.key,
            "loss": float(loss.detach()),
            "expected": expected,
            "names": set(ours) == set(grads) and all(g is not None for g in grads.values()),
            "grad_error": max(
                float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items()
            ),
            "first_frame": batch.draw.first_frame.tolist(),
            "timestep_shape": tuple(seen["timestep"].shape),
            "zero_tokens": int((seen["timestep"] == 0).sum()),
        }
    return results


def test_ti2v_loss_and_gradients_equal_diffusers(ti2v_run) -> None:
    model_dir, features = ti2v_run
    assert dit_family_of(model_dir).key == TI2V
    results = launch(_parity, (model_dir, features))
    tokens_per_frame = 2 * 2  # latents of 4 x 4, patch 2 x 2
    for name, result in results.items():
        print(
            f"TI2V {name}: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative gradient "
            f"error {result['grad_error']:.1e}, first frame given {result['first_frame']}"
        )
        assert result["family"] == TI2V and result["names"], name
        assert result["timestep_shape"] == (4, 3 * tokens_per_frame), name  # a timestep per token
        assert result["zero_tokens"] == tokens_per_frame * sum(result["first_frame"]), name
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), name
        assert result["grad_error"] < 1e-5, (name, result["grad_error"])
    assert set(results["mixed"]["first_frame"]) == {True, False}
    assert not any(results["text-to-video"]["first_frame"]) and all(results["image-to-video"]["first_frame"])


def _train_export(model_dir, features, target) -> list[dict]:
    from mindspeed_mm.trainer.loop import train

    extra = {"train.steps": 2, "train.lr": 1e-3, "train.micro_batch_size": 2, "checkpoint.save_hf": str(target)}
    config = load_mm_config(None, _overrides(model_dir, features, **extra, **{"diffusion.first_frame_ratio": 0.5}))
    return train(config).records


def test_ti2v_training_export_loads_in_diffusers(ti2v_run, tmp_path) -> None:
    """Two ``train`` steps (half the samples image-to-video); ``checkpoint.save_hf`` loads in diffusers with no
    missing, unexpected or mismatched keys and holds trained weights."""
    from diffusers import WanTransformer3DModel

    model_dir, features = ti2v_run
    records = launch(_train_export, (model_dir, features, tmp_path / "export"))
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    loaded, info = WanTransformer3DModel.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    before = WanTransformer3DModel.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(before[n], w) for n, w in loaded.state_dict().items())
