"""The DiT sampler against diffusers' pipelines: same initial latents and text embeddings, same output.

- Wan: ``WanPipeline`` (with ``prompt_embeds`` / ``negative_prompt_embeds`` / ``latents``) and our
  loop give the same latents and the same decoded video (a tiny ``AutoencoderKLWan``), with UniPC in
  flow mode (Wan's shipped scheduler) and with Euler, under classifier-free guidance.
- FLUX: ``FluxPipeline`` with true CFG (``true_cfg_scale``, negative embeddings) and a
  guidance-distilled model's ``guidance_scale``: same latents (packed) and image (a tiny ``AutoencoderKL``),
  with its resolution-dependent shift (``mu``) on the Euler scheduler.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mindspeed_mm.diffusion.sampler import build_scheduler, decode_latents, sample_latents
from mindspeed_mm.models.dit import DIT_FAMILIES
from mindspeed_mm.models.flux import pack_latents

WAN, FLUX = "WanTransformer3DModel", "FluxTransformer2DModel"


def _tiny_wan_vae(z_dim: int = 4):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(
        base_dim=3,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0][:z_dim],
        latents_std=[1.5, 0.5, 2.0, 1.0][:z_dim],
    ).eval()


def _tiny_flux_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    ).eval()


@pytest.mark.parametrize("sampler", ["unipc", "euler"])
def test_wan_sampler_equals_wan_pipeline(sampler) -> None:
    from diffusers import WanPipeline

    family = DIT_FAMILIES.get(WAN)
    torch.manual_seed(0)
    model = family.load_class()(**family.tiny_config).eval()
    vae = _tiny_wan_vae()
    scheduler = build_scheduler(family, sampler=sampler if sampler == "euler" else None, flow_shift=3.0)
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(2, 4, 3, 2, 2, generator=gen)  # 9 frames of 16 x 16 pixels
    text, negative = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=copy.deepcopy(scheduler), transformer=model
    )
    kwargs = {
        "prompt_embeds": text,
        "negative_prompt_embeds": negative,
        "latents": latents,
        "height": 16,
        "width": 16,
        "num_frames": 9,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
    }
    theirs_latents = pipe(**kwargs, output_type="latent").frames
    theirs_video = pipe(**kwargs, output_type="pt").frames

    ours_latents = sample_latents(
        model, family, scheduler, latents, text, 4, negative_text=negative, guidance_scale=4.0
    )
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    ours_video = decode_latents(vae, ours_latents)
    assert ours_video.shape == theirs_video.shape == (2, 9, 3, 16, 16)
    torch.testing.assert_close(ours_video, theirs_video, rtol=1e-6, atol=1e-6)
    assert (ours_latents - latents).abs().mean() > 0.1  # it moved


def test_flux_sampler_equals_flux_pipeline() -> None:
    from diffusers import FluxPipeline

    family = DIT_FAMILIES.get(FLUX)
    torch.manual_seed(0)
    model = family.load_class()(**family.tiny_config).eval()
    vae = _tiny_flux_vae()
    scheduler = build_scheduler(family)
    assert scheduler.config.use_dynamic_shifting
    gen = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    text, negative = torch.randn(2, 6, 32, generator=gen), torch.randn(2, 6, 32, generator=gen)
    pooled, negative_pooled = torch.randn(2, 32, generator=gen), torch.randn(2, 32, generator=gen)
    pipe = FluxPipeline(
        scheduler=copy.deepcopy(scheduler),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=model,
    )
    kwargs = {
        "prompt_embeds": text,
        "pooled_prompt_embeds": pooled,
        "negative_prompt_embeds": negative,
        "negative_pooled_prompt_embeds": negative_pooled,
        "latents": pack_latents(latents),
        "height": 8,
        "width": 8,
        "num_inference_steps": 3,
        "true_cfg_scale": 2.5,
        "guidance_scale": 3.5,
    }
    theirs_latents = pipe(**kwargs, output_type="latent").images
    theirs_image = pipe(**kwargs, output_type="pt").images

    ours_latents = sample_latents(
        model,
        family,
        scheduler,
        latents,
        text,
        3,
        pooled=pooled,
        negative_text=negative,
        negative_pooled=negative_pooled,
        guidance_scale=2.5,
        distilled_guidance=3.5,
    )
    torch.testing.assert_close(pack_latents(ours_latents), theirs_latents, rtol=1e-6, atol=1e-6)
    ours_image = decode_latents(vae, ours_latents)
    assert ours_image.shape == theirs_image.shape == (2, 3, 8, 8)
    torch.testing.assert_close(ours_image, theirs_image, rtol=1e-6, atol=1e-6)


def test_wan22_two_experts_equal_wan_pipeline() -> None:
    """Wan2.2: ``WanPipeline(transformer, transformer_2, boundary_ratio)`` with ``guidance_scale_2``."""
    from diffusers import WanPipeline

    family = DIT_FAMILIES.get(WAN)
    experts = []
    for seed in (0, 7):
        torch.manual_seed(seed)
        experts.append(family.load_class()(**family.tiny_config).eval())
    calls = {"high": 0, "low": 0}
    experts[0].register_forward_pre_hook(lambda m, a, k: calls.update(high=calls["high"] + 1), with_kwargs=True)
    experts[1].register_forward_pre_hook(lambda m, a, k: calls.update(low=calls["low"] + 1), with_kwargs=True)
    vae = _tiny_wan_vae()
    scheduler = build_scheduler(family, flow_shift=3.0)
    gen = torch.Generator().manual_seed(8)
    latents = torch.randn(2, 4, 3, 2, 2, generator=gen)
    text, negative = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=copy.deepcopy(scheduler),
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=0.875,
    )
    kwargs = {
        "prompt_embeds": text,
        "negative_prompt_embeds": negative,
        "latents": latents,
        "height": 16,
        "width": 16,
        "num_frames": 9,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
        "guidance_scale_2": 3.0,
    }
    theirs_latents = pipe(**kwargs, output_type="latent").frames
    theirs_video = pipe(**kwargs, output_type="pt").frames
    assert calls["high"] > 0 and calls["low"] > 0  # both experts denoised
    calls.update(high=0, low=0)
    ours_latents = sample_latents(
        experts[0],
        family,
        scheduler,
        latents,
        text,
        4,
        negative_text=negative,
        guidance_scale=4.0,
        model_2=experts[1],
        boundary_ratio=0.875,
        guidance_scale_2=3.0,
    )
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(decode_latents(vae, ours_latents), theirs_video, rtol=1e-6, atol=1e-6)
    print(f"expert calls per sampling (cond + uncond): {calls}")
    assert calls["high"] > 0 and calls["low"] > 0
    # the second expert changes the result (not the single-expert sampler by another name)
    single = sample_latents(experts[0], family, scheduler, latents, text, 4, negative_text=negative, guidance_scale=4.0)
    assert (single - ours_latents).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs boundary_ratio"):
        sample_latents(experts[0], family, scheduler, latents, text, 4, model_2=experts[1])


@pytest.mark.parametrize(
    ("image_dim", "pair"),
    [(16, False), (None, False), (None, True)],
    ids=["wan2.1-i2v", "wan2.2-i2v", "wan2.2-i2v-pair"],
)
def test_wan_i2v_sampler_equals_wan_image_to_video_pipeline(image_dim, pair) -> None:
    """Wan I2V: ``WanImageToVideoPipeline(image=...)`` and our loop on the conditions of
    :func:`~mindspeed_mm.models.encoders.encode_first_frame` (the family's ``image_conditions``); with ``pair``
    Wan2.2 I2V A14B's two experts (``transformer_2``, ``boundary_ratio`` 0.9, ``guidance_scale_2`` 3)."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts

    family = DIT_FAMILIES.get("WanTransformer3DModel:i2v")
    parts = tiny_i2v_parts(image_dim=image_dim)
    scheduler = build_scheduler(family, flow_shift=3.0)
    gen = torch.Generator().manual_seed(9)
    image = Image.fromarray((torch.rand(24, 20, 3, generator=gen) * 255).to(torch.uint8).numpy())  # resized to 16
    latents = torch.randn(2, 4, 3, 2, 2, generator=gen)  # 9 frames of 16 x 16 pixels
    text, negative = torch.randn(2, 512, 16, generator=gen), torch.randn(2, 512, 16, generator=gen)
    experts = {}
    if pair:
        torch.manual_seed(7)
        config = {**family.tiny_config, "image_dim": None, "added_kv_proj_dim": None}
        experts = {"transformer_2": family.load_class()(**config).eval(), "boundary_ratio": 0.9}
    calls = []
    if pair:  # both experts denoise some steps
        experts["transformer_2"].register_forward_pre_hook(lambda module, args: calls.append(1))
    pipe = WanImageToVideoPipeline(**{**parts, **experts, "scheduler": copy.deepcopy(scheduler)})
    pair_kwargs = {"guidance_scale_2": 3.0} if pair else {}
    kwargs = {
        **pair_kwargs,
        "image": image,
        "prompt_embeds": text,
        "negative_prompt_embeds": negative,
        "latents": latents,
        "height": 16,
        "width": 16,
        "num_frames": 9,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
    }
    theirs_latents = pipe(**kwargs, output_type="latent").frames
    theirs_video = pipe(**kwargs, output_type="pt").frames
    assert bool(calls) == pair and len(calls) < 2 * 2 * 4  # transformer_2 ran, not on every step

    one = family.image_conditions(parts, image, 9, 16, 16)
    assert sorted(one) == (["image_embeds", "image_latents"] if image_dim else ["image_latents"])
    conditions = {key: value[None].expand(2, *value.shape) for key, value in one.items()}
    ours_latents = sample_latents(
        parts["transformer"],
        family,
        scheduler,
        latents,
        text,
        4,
        negative_text=negative,
        guidance_scale=4.0,
        conditions=conditions,
        model_2=experts.get("transformer_2"),
        boundary_ratio=experts.get("boundary_ratio"),
        **pair_kwargs,
    )
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(decode_latents(parts["vae"], ours_latents), theirs_video, rtol=1e-6, atol=1e-6)
    # the image matters: another first frame gives another video
    other = family.image_conditions(parts, image.transpose(Image.Transpose.FLIP_LEFT_RIGHT), 9, 16, 16)
    flipped = sample_latents(
        parts["transformer"],
        family,
        scheduler,
        latents,
        text,
        4,
        negative_text=negative,
        guidance_scale=4.0,
        conditions={key: value[None].expand(2, *value.shape) for key, value in other.items()},
        model_2=experts.get("transformer_2"),
        boundary_ratio=experts.get("boundary_ratio"),
        **pair_kwargs,
    )
    print(
        f"I2V ({'image_dim' if image_dim else 'no image encoder'}{', two experts' if pair else ''}): max |ours - pipeline| "
        f"{(ours_latents - theirs_latents).abs().max():.1e}, flipped image moves {(flipped - ours_latents).abs().max():.2f}"
    )
    assert (flipped - ours_latents).abs().max() > 1e-3


def test_wan22_ti2v_sampler_equals_pipelines() -> None:
    """Wan2.2 TI2V-5B (``expand_timesteps``, the Wan2.2 VAE: 48 channels, patch 2, residual): our loop equals
    ``WanPipeline(expand_timesteps=True)`` without an image (text to video: every token at ``t``) and
    ``WanImageToVideoPipeline(expand_timesteps=True)(image=...)`` with one (the image's latents as the first latent
    frame at timestep 0, put back at the end), in latents and decoded video."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_ti2v_parts

    family = DIT_FAMILIES.get("WanTransformer3DModel:ti2v")
    parts = tiny_ti2v_parts()
    scheduler = build_scheduler(family, flow_shift=3.0)
    gen = torch.Generator().manual_seed(9)
    image = Image.fromarray((torch.rand(40, 70, 3, generator=gen) * 255).to(torch.uint8).numpy())  # to 32 x 64
    latents = torch.randn(2, 48, 3, 2, 4, generator=gen)  # 9 frames of 32 x 64 pixels
    text, negative = torch.randn(2, 512, 16, generator=gen), torch.randn(2, 512, 16, generator=gen)
    kwargs = {
        "prompt_embeds": text,
        "negative_prompt_embeds": negative,
        "latents": latents,
        "height": 32,
        "width": 64,
        "num_frames": 9,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
    }
    pipes = {"text-to-video": (WanPipeline, {}), "image-to-video": (WanImageToVideoPipeline, {"image": image})}
    results = {}
    for name, (cls, extra) in pipes.items():
        seen = []
        handle = parts["transformer"].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
        )
        pipe = cls(**{**parts, "scheduler": copy.deepcopy(scheduler)}, expand_timesteps=True)
        theirs_latents = pipe(**kwargs, **extra, output_type="latent").frames
        theirs_video = pipe(**kwargs, **extra, output_type="pt").frames
        conditions = None
        if extra:
            one = family.image_conditions(parts, image, 9, 32, 64)
            assert one["image_latents"].shape == (48, 1, 2, 4)
            conditions = {key: value[None].expand(2, *value.shape) for key, value in one.items()}
        seen.clear()
        ours_latents = sample_latents(
            parts["transformer"],
            family,
            scheduler,
            latents,
            text,
            4,
            negative_text=negative,
            guidance_scale=4.0,
            conditions=conditions,
        )
        handle.remove()
        torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(decode_latents(parts["vae"], ours_latents), theirs_video, rtol=1e-6, atol=1e-6)
        assert seen[0].shape == (2, 3 * 2) and len(seen) == 8  # a timestep per token, cond + uncond x 4 steps
        assert bool((seen[0][:, :2] == 0).all()) == bool(extra) and bool((seen[0][:, 2:] > 0).all())
        results[name] = ours_latents
        print(f"TI2V {name}: max |ours - pipeline| {(ours_latents - theirs_latents).abs().max():.1e}")
    # the image is the first latent frame; the rest of the video differs from text-to-video's
    torch.testing.assert_close(results["image-to-video"][:, :, :1], conditions["image_latents"])
    assert (results["image-to-video"][:, :, 1:] - results["text-to-video"][:, :, 1:]).abs().max() > 1e-3


def test_wan_flf2v_sampler_equals_wan_image_to_video_pipeline() -> None:
    """Wan2.1 FLF2V: ``WanImageToVideoPipeline(image=..., last_image=...)`` and our loop on the family's
    ``image_conditions(..., last_image=...)`` (the video ``[first, zeros, last]``'s latents, both frames' CLIP
    features): the same latents and decoded video; another last frame changes them."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from mindspeed_mm.testing.media_fixtures import tiny_i2v_parts

    family = DIT_FAMILIES.get("WanTransformer3DModel:flf2v")
    parts = tiny_i2v_parts(flf2v=True)
    scheduler = build_scheduler(family, flow_shift=3.0)
    gen = torch.Generator().manual_seed(11)
    first, last = (Image.fromarray((torch.rand(24, 20, 3, generator=gen) * 255).to(torch.uint8).numpy()) for _ in "ab")
    latents = torch.randn(2, 4, 3, 2, 2, generator=gen)  # 9 frames of 16 x 16 pixels
    text, negative = torch.randn(2, 512, 16, generator=gen), torch.randn(2, 512, 16, generator=gen)
    pipe = WanImageToVideoPipeline(**{**parts, "scheduler": copy.deepcopy(scheduler)})
    kwargs = {
        "image": first,
        "last_image": last,
        "prompt_embeds": text,
        "negative_prompt_embeds": negative,
        "latents": latents,
        "height": 16,
        "width": 16,
        "num_frames": 9,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
    }
    theirs_latents = pipe(**kwargs, output_type="latent").frames
    theirs_video = pipe(**kwargs, output_type="pt").frames

    def ours(last_image):
        one = family.image_conditions(parts, first, 9, 16, 16, last_image=last_image)
        assert one["image_embeds"].shape == (34, 16)  # two images of 17 tokens
        conditions = {key: value[None].expand(2, *value.shape) for key, value in one.items()}
        return sample_latents(
            parts["transformer"],
            family,
            scheduler,
            latents,
            text,
            4,
            negative_text=negative,
            guidance_scale=4.0,
            conditions=conditions,
        )

    ours_latents = ours(last)
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(decode_latents(parts["vae"], ours_latents), theirs_video, rtol=1e-6, atol=1e-6)
    moved = (ours(last.transpose(Image.Transpose.FLIP_LEFT_RIGHT)) - ours_latents).abs().max()
    print(
        f"FLF2V: max |ours - pipeline| {(ours_latents - theirs_latents).abs().max():.1e}, flipped last frame moves {moved:.2f}"
    )
    assert moved > 1e-3
    with pytest.raises(ValueError, match="needs the last frame too"):
        family.image_conditions(parts, first, 9, 16, 16)
