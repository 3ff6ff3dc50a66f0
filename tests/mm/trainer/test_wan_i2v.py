"""Wan image-to-video training (the ``WanTransformer3DModel:i2v`` family) against diffusers.

- A model directory whose input has more channels than its output is the ``i2v`` variant.
- A training microbatch's loss and every parameter's gradient equal a reference computed with a
  separately loaded diffusers ``WanTransformer3DModel``, called as ``WanImageToVideoPipeline``
  calls it: the noisy latents concatenated on channels with the pipeline's own condition (its
  ``prepare_latents``' mask over the latent frames, then the cached first-frame latents), and the
  cached image features as ``encoder_hidden_states_image`` (Wan2.1 I2V); and with a Wan2.2 I2V
  configuration (no image encoder: ``image_dim`` unset). Text dropout leaves the image condition.
- Wan2.2 I2V A14B's two experts (``diffusion.expert=both``): each sample goes to the expert of its timestep
  with its own condition; loss and every gradient of both experts equal diffusers' experts routed by hand.
- Under bf16 (FSDP2's policy) the loss stays within 2% of fp32's.
"""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.models.dit import dit_family_of, write_tiny_dit
from mindspeed_mm.testing.dit_fixtures import write_tiny_dit_run
from mindspeed_mm.trainer.task import TASKS

I2V = "WanTransformer3DModel:i2v"
FLF2V = "WanTransformer3DModel:flf2v"
#: Wan2.2 I2V A14B's boundary_ratio
RATIO = 0.9
#: Wan2.1 I2V's attention takes the context's last 512 tokens as the text.
TEXT_LEN = 512


@pytest.fixture(scope="module")
def i2v_run(tmp_path_factory):
    """A tiny Wan2.1 I2V transformer, a Wan2.2-style one (no image_dim) and a feature cache with conditions."""
    root = tmp_path_factory.mktemp("wan-i2v")
    model, features = write_tiny_dit_run(root, I2V, num_samples=6)
    wan22 = write_tiny_dit(root / "wan22", I2V, seed=3, image_dim=None, added_kv_proj_dim=None)
    for folder, seed in (("transformer", 4), ("transformer_2", 5)):  # a Wan2.2 I2V A14B-style pair
        write_tiny_dit(root / "pair" / folder, I2V, seed=seed, image_dim=None, added_kv_proj_dim=None)
    (root / "pair" / "model_index.json").write_text(json.dumps({"boundary_ratio": RATIO}))
    return model, wan22, features


def _overrides(model_dir, features, **extra) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.features={features}",
        f"data.text_len={TEXT_LEN}",
        "data.shuffle=false",
        "train.precision=fp32",
        "logging.progress=false",
        "diffusion.shift=5.0",
        *[f"{k}={v}" for k, v in extra.items()],
    ]


def _pipeline_mask(batch: int, latent_shape: tuple[int, ...], last: bool = False) -> torch.Tensor:
    """``WanImageToVideoPipeline.prepare_latents``' mask channels for latents of ``latent_shape`` (``C, F, H, W``);
    with ``last`` given a ``last_image`` too (FLF2V)."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline

    channels, frames, height, width = latent_shape
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
    ).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=None,
        transformer=None,
        image_encoder=None,
        image_processor=None,
    )
    image = torch.zeros(1, 3, height * 8, width * 8)  # one image, repeated over the batch by the pipeline
    with torch.no_grad():
        _, condition = pipe.prepare_latents(
            image,
            batch,
            channels,
            height * 8,
            width * 8,
            (frames - 1) * 4 + 1,
            torch.float32,
            torch.device("cpu"),
            last_image=image if last else None,
        )
    return condition[:, : condition.shape[1] - channels]


def _reference(task, batch, pair: bool = False) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    """Loss and gradients of diffusers models called as the pipeline calls them (with ``pair``: both experts,
    each sample routed by hand, ``t >= boundary``: ``transformer``); the experts the samples went to."""
    from diffusers import WanTransformer3DModel

    indices, latents, noise = batch.draw.indices, batch.latents, batch.draw.noise
    sigmas = task.flow.sigmas[indices]
    shaped = sigmas.reshape(-1, 1, 1, 1, 1)
    noisy = (1.0 - shaped) * latents + shaped * noise
    text, _ = task.model_text(batch)
    last = task.family.last_frame  # FLF2V: the mask of WanImageToVideoPipeline(last_image=...)
    mask = _pipeline_mask(len(indices), tuple(latents.shape[1:]), last)
    inputs = torch.cat([noisy, mask, batch.conditions["image_latents"]], dim=1)
    image = batch.conditions.get("image_embeds")
    if last:  # the pipeline's encode_image([image, last_image]).repeat(batch, 1, 1): [first, last] rows per sample
        image = image.reshape(-1, image.shape[1] // 2, image.shape[2])
    folders = ("transformer", "transformer_2") if pair else (task.source.name,)
    models = {name: WanTransformer3DModel.from_pretrained(task.source.parent / name) for name in folders}
    routed = [folders[0] if not pair or t >= RATIO * 1000 else folders[1] for t in (sigmas * 1000.0).tolist()]
    pred = torch.zeros_like(latents)
    for name, model in models.items():
        rows = [i for i, expert in enumerate(routed) if expert == name]
        if rows:
            image_rows = [2 * r + k for r in rows for k in range(2)] if last else rows
            pred[rows] = model(
                hidden_states=inputs[rows],
                timestep=sigmas[rows] * 1000.0,
                encoder_hidden_states=text[rows],
                encoder_hidden_states_image=image[image_rows] if image is not None else None,
                return_dict=False,
            )[0]
    loss = ((pred.float() - (noise - latents).float()) ** 2).reshape(len(indices), -1).mean(1).mean()
    loss.backward()
    prefix = (lambda name: f"{name}.") if pair else (lambda name: "")
    grads = {prefix(name) + n: p.grad for name, model in models.items() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, routed


def _parity(model_dir, wan22_dir, pair_dir, features) -> dict:
    results = {}
    cases = (("wan2.1", model_dir, 3, "none"), ("wan2.2", wan22_dir, 3, "none"), ("pair", pair_dir, 6, "both"))
    for name, path, micro, expert in cases:
        extra = {
            "train.micro_batch_size": micro,
            "diffusion.loss_weighting": "none",
            "diffusion.text_dropout": 0.7,
            "diffusion.expert": expert,
        }
        task = TASKS.get("dit")(load_mm_config(None, _overrides(path, features, **extra)), 1)
        batch = task.microbatches(1, 0)[0]
        loss, _ = task.loss(batch, torch.zeros(2))
        loss.backward()
        ours = {n: p.grad for n, p in task.model.named_parameters()}
        expected, grads, routed = _reference(task, batch, pair=expert == "both")
        results[name] = {
            "family": task.family.key,
            "loss": float(loss.detach()),
            "expected": expected,
            "names": set(ours) == set(grads) and all(g is not None for g in grads.values()),
            "grad_error": max(
                float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items()
            ),
            "conditions": sorted(batch.conditions),
            "dropped": batch.draw.drop.tolist(),
            "routed": routed,
        }
    losses = {}
    for precision in ("fp32", "bf16"):
        config = load_mm_config(None, _overrides(model_dir, features, **{"train.precision": precision}))
        task = TASKS.get("dit")(config, 1)
        loss = task.loss(task.microbatches(1, 0)[0], torch.zeros(2))[0]
        loss.backward()
        losses[precision] = float(loss.detach())
    results["bf16"] = losses
    return results


def test_i2v_loss_and_gradients_equal_diffusers(i2v_run) -> None:
    model_dir, wan22_dir, features = i2v_run
    assert dit_family_of(model_dir).key == dit_family_of(wan22_dir).key == I2V
    pair_dir = wan22_dir.parent / "pair" / "transformer"
    results = launch(_parity, (model_dir, wan22_dir, pair_dir, features))
    assert set(results["pair"]["routed"]) == {"transformer", "transformer_2"}  # one microbatch on both experts
    cases = (("wan2.1", ["image_embeds", "image_latents"]), ("wan2.2", ["image_latents"]), ("pair", ["image_latents"]))
    for name, conditions in cases:
        result = results[name]
        print(
            f"{name} I2V: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative gradient "
            f"error {result['grad_error']:.1e}, text dropped {result['dropped']}, experts {result['routed']}"
        )
        assert result["family"] == I2V and result["conditions"] == conditions
        assert result["names"], name
        assert True in result["dropped"] and False in result["dropped"], name  # dropout on some samples
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), name
        assert result["grad_error"] < 1e-5, (name, result["grad_error"])
    fp32, bf16 = results["bf16"]["fp32"], results["bf16"]["bf16"]
    print(f"wan2.1 I2V: fp32 loss {fp32:.6f}, bf16 (FSDP2) {bf16:.6f}")
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32


def _train_export(model_dir, features, target) -> list[dict]:
    from mindspeed_mm.trainer.loop import train

    extra = {"train.steps": 2, "train.lr": 1e-3, "train.micro_batch_size": 2, "checkpoint.save_hf": str(target)}
    return train(load_mm_config(None, _overrides(model_dir, features, **extra))).records


def test_i2v_training_export_loads_in_diffusers(i2v_run, tmp_path) -> None:
    """Two steps of ``train``; ``checkpoint.save_hf`` is an I2V transformer that diffusers loads with no missing,
    unexpected or mismatched keys, holding trained weights."""
    from diffusers import WanTransformer3DModel

    model_dir, _, features = i2v_run
    records = launch(_train_export, (model_dir, features, tmp_path / "export"))
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] > 0 for r in records)
    loaded, info = WanTransformer3DModel.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.config.image_dim == 16 and loaded.config.in_channels == 12
    assert dit_family_of(tmp_path / "export").key == I2V
    before = WanTransformer3DModel.from_pretrained(model_dir).state_dict()
    changed = [n for n, w in loaded.state_dict().items() if not torch.equal(before[n], w)]
    assert any("image_embedder" in n for n in changed) and any("add_k_proj" in n for n in changed)


def test_i2v_input_errors() -> None:
    from mindspeed_mm.models.dit import DIT_FAMILIES

    family = DIT_FAMILIES.get(I2V)
    config = dict(family.tiny_config)
    noisy, sigmas = torch.zeros(1, 4, 3, 4, 4), torch.ones(1)
    text, image_latents, embeds = torch.zeros(1, TEXT_LEN, 16), torch.zeros(1, 4, 3, 4, 4), torch.zeros(1, 5, 16)
    inputs = family.model_inputs(
        config, noisy, sigmas, text, None, 1.0, image_latents=image_latents, image_embeds=embeds
    )
    mask = inputs["hidden_states"][:, 4:8]
    assert inputs["hidden_states"].shape == (1, 12, 3, 4, 4) and inputs["encoder_hidden_states_image"] is embeds
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()
    with pytest.raises(ValueError, match="set data.text_len .* to 512"):
        family.model_inputs(
            config, noisy, sigmas, text[:, :8], None, 1.0, image_latents=image_latents, image_embeds=embeds
        )
    with pytest.raises(ValueError, match="needs the first frame's latents"):
        family.model_inputs(config, noisy, sigmas, text, None, 1.0)
    with pytest.raises(ValueError, match="needs the image encoder's features"):
        family.model_inputs(config, noisy, sigmas, text, None, 1.0, image_latents=image_latents)
    with pytest.raises(ValueError, match="leaves no mask channel"):
        family.model_inputs({**config, "in_channels": 8}, noisy, sigmas, text, None, 1.0, image_latents=image_latents)


def _flf2v_parity(model_dir, features) -> dict:
    extra = {"train.micro_batch_size": 3, "diffusion.text_dropout": 0.7}
    task = TASKS.get("dit")(load_mm_config(None, _overrides(model_dir, features, **extra)), 1)
    batch = task.microbatches(1, 0)[0]
    loss, _ = task.loss(batch, torch.zeros(2))
    loss.backward()
    ours = {n: p.grad for n, p in task.model.named_parameters()}
    expected, grads, _ = _reference(task, batch)
    return {
        "family": task.family.key,
        "loss": float(loss.detach()),
        "expected": expected,
        "names": set(ours) == set(grads) and all(g is not None for g in grads.values()),
        "grad_error": max(float((ours[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items()),
        "pos_embed_grad": float(ours["condition_embedder.image_embedder.pos_embed"].abs().max()),
        "mask": task.family.model_inputs(
            task.model.config,
            batch.latents,
            task.flow.sigmas[batch.draw.indices],
            batch.text,
            None,
            1.0,
            **batch.conditions,
        )["hidden_states"][:, 4:8],
    }


def test_flf2v_loss_and_gradients_equal_diffusers(tmp_path) -> None:
    """Wan2.1 FLF2V (``pos_embed_seq_len``: the ``flf2v`` variant): the input's mask is
    ``WanImageToVideoPipeline.prepare_latents(..., last_image=...)``'s (the first latent frame and the last one's last
    channel), the two frames' image features go in as the pipeline's ``[first, last]`` rows; loss and every gradient
    equal diffusers' (the position embedding of the two images' features trains)."""
    model_dir, features = write_tiny_dit_run(tmp_path, FLF2V, num_samples=3)
    assert dit_family_of(model_dir).key == FLF2V
    result = launch(_flf2v_parity, (model_dir, features))
    print(
        f"FLF2V: loss {result['loss']:.6f} (diffusers {result['expected']:.6f}), max relative gradient error "
        f"{result['grad_error']:.1e}"
    )
    assert result["family"] == FLF2V and result["names"]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
    assert result["grad_error"] < 1e-5 and result["pos_embed_grad"] > 0
    mask = result["mask"]
    assert mask[:, :, 0].eq(1).all() and mask[:, :3, 1:].eq(0).all() and mask[:, 3, 1].eq(0).all()
    assert mask[:, 3, -1].eq(1).all()
