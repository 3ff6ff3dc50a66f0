"""SD3 against ``StableDiffusion3Pipeline`` on tiny components built in code (two CLIPs with projection, a T5,
an ``AutoencoderKL``, the family's tiny ``SD3Transformer2DModel``):

- text: the family's ``encode_prompts`` and extract-features' encoder set (the pipeline directory written by
  the pipeline's ``save_pretrained``, loaded as ``data.encoders``) equal ``encode_prompt``'s
  ``prompt_embeds`` and ``pooled_prompt_embeds`` (CLIP penultimate states padded to T5's width, T5's output after
  them; both CLIPs' pooled outputs);
- sampling: our loop with classifier-free guidance gives the pipeline's latents and decoded image from the same
  embeddings and initial latents (SD3's shift 3, and a dynamically shifted scheduler: the pipeline's ``mu``),
  and with skip-layer guidance (``skip_guidance_layers``: on steps 1 and 2 of 4) on SD3.5's blocks;
- ``mindspeed-mm generate`` on the saved pipeline directory writes the images that the pipeline loaded with
  ``from_pretrained`` makes from the same prompts, empty negative prompt and seed noise (and with
  ``--skip-guidance-layers``); SLG's bad inputs are one-line errors.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from mindspeed_mm.diffusion.sampler import SkipLayerGuidance, build_scheduler, decode_latents, sample_latents
from mindspeed_mm.models.dit import DIT_FAMILIES

SD3 = "SD3Transformer2DModel"
CLIP_LEN = 6
T5_LEN = 5
TEXT_LEN = CLIP_LEN + T5_LEN
WORDS = ["a", "red", "blue", "square", "circle", "in", "the", "top", "left", "bottom", "right"]
PROMPTS = ["a red square in the top left", "a blue circle"]


def _tokenizer(max_length: int):
    from mindspeed_mm.demos.scene import word_tokenizer

    tokenizer = word_tokenizer(WORDS)
    tokenizer.model_max_length = max_length
    return tokenizer


#: SD3.5's blocks: an image-only second attention in block 0, QK RMSNorm
SD35 = {"dual_attention_layers": (0,), "qk_norm": "rms_norm"}
#: skip-layer guidance over 4 steps: 4 x 0.01 < i < 4 x 0.6 applies it on steps 1 and 2 (not 0 and 3)
SLG = {"skip_guidance_layers": [0], "skip_layer_guidance_scale": 2.8, "skip_layer_guidance_start": 0.01}
SLG_STOP = 0.6


def _tiny_parts(**transformer_config) -> dict:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    family = DIT_FAMILIES.get(SD3)
    torch.manual_seed(0)
    transformer = family.load_class()(**{**family.tiny_config, **transformer_config}).eval()
    clips = []
    for _ in range(2):
        config = CLIPTextConfig(
            vocab_size=len(WORDS) + 3,
            hidden_size=16,
            intermediate_size=32,
            projection_dim=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=CLIP_LEN,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
        clips.append(CLIPTextModelWithProjection(config).eval())
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(WORDS) + 3,
            d_model=family.tiny_config["joint_attention_dim"],
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).eval()
    vae = AutoencoderKL(
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
        scaling_factor=1.5305,
    ).eval()
    return {
        "transformer": transformer,
        "scheduler": build_scheduler(family),
        "vae": vae,
        "text_encoder": clips[0],
        "tokenizer": _tokenizer(CLIP_LEN),
        "text_encoder_2": clips[1],
        "tokenizer_2": _tokenizer(CLIP_LEN),
        "text_encoder_3": t5,
        "tokenizer_3": _tokenizer(512),
    }


def test_sd3_prompts_and_extracted_text_equal_pipeline(tmp_path) -> None:
    from diffusers import StableDiffusion3Pipeline

    from mindspeed_mm.data.encoder_set import EncoderSet

    family = DIT_FAMILIES.get(SD3)
    parts = _tiny_parts()
    pipe = StableDiffusion3Pipeline(**parts)
    with torch.no_grad():  # as the pipeline's __call__ runs it (grad mode changes T5's float rounding)
        theirs, _, theirs_pooled, _ = pipe.encode_prompt(
            PROMPTS + [""], None, None, do_classifier_free_guidance=False, max_sequence_length=T5_LEN
        )
    assert theirs.shape == (3, TEXT_LEN, 48) and theirs_pooled.shape == (3, 32)
    text, pooled = family.encode_prompts(parts, PROMPTS + [""], TEXT_LEN)
    torch.testing.assert_close(text, theirs, rtol=0, atol=0)
    torch.testing.assert_close(pooled, theirs_pooled, rtol=0, atol=0)
    assert text[:, :CLIP_LEN].abs().amax() > 0 and text[:, CLIP_LEN:].abs().amax() > 0  # both encoders there
    assert torch.equal(text[:, :CLIP_LEN, 32:], torch.zeros(3, CLIP_LEN, 16))  # CLIP 2 x 16 padded to 48

    pipe.save_pretrained(tmp_path / "pipe")
    encoders = EncoderSet(tmp_path / "pipe", SD3, TEXT_LEN, torch.device("cpu"))
    for i, caption in enumerate(PROMPTS + [""]):  # one caption at a time: a batch of 1 rounds the matmuls its own way
        row = encoders.encode_text(caption)
        torch.testing.assert_close(row["text"], theirs[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(row["pooled"], theirs_pooled[i], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="leaves no T5 token beside CLIP's 6"):
        family.encode_prompts(parts, PROMPTS, CLIP_LEN)
    # clip_skip 1: the CLIPs' features one layer before the penultimate (the first layer's of 2)
    with torch.no_grad():
        skipped, _, skipped_pooled, _ = pipe.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=T5_LEN, clip_skip=1
        )
    text_1, pooled_1 = family.encode_prompts(parts, PROMPTS, TEXT_LEN, clip_skip=1)
    torch.testing.assert_close(text_1, skipped, rtol=0, atol=0)
    torch.testing.assert_close(pooled_1, skipped_pooled, rtol=0, atol=0)
    assert (text_1[:, :CLIP_LEN] - text[:2, :CLIP_LEN]).abs().amax() > 1e-2
    with pytest.raises(ValueError, match=r"^--clip-skip 2: the CLIP encoders have 2 layers; give 0 to 1$"):
        family.encode_prompts(parts, PROMPTS, TEXT_LEN, clip_skip=2)


@pytest.mark.parametrize(
    "dynamic, slg", [(False, False), (True, False), (False, True)], ids=["shift-3", "dynamic-shift", "sd3.5-slg"]
)
def test_sd3_sampler_equals_pipeline(dynamic, slg) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    family = DIT_FAMILIES.get(SD3)
    parts = _tiny_parts(**(SD35 if slg else {}))
    steps = 4 if slg else 3
    model, vae, scheduler = parts["transformer"], parts["vae"], parts["scheduler"]
    if dynamic:  # the pipeline's resolution-dependent mu (image tokens over patch 2)
        config = {**family.scheduler[1], "use_dynamic_shifting": True, "base_image_seq_len": 4, "max_image_seq_len": 64}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        assert family.timestep_kwargs(scheduler.config, 3, (2, 4, 8, 8))["mu"] != 0.5
    pipe = StableDiffusion3Pipeline(**{**parts, "scheduler": copy.deepcopy(scheduler)})
    gen = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 8, 8, generator=gen)
    text, negative = torch.randn(2, TEXT_LEN, 48, generator=gen), torch.randn(2, TEXT_LEN, 48, generator=gen)
    pooled, negative_pooled = torch.randn(2, 32, generator=gen), torch.randn(2, 32, generator=gen)
    kwargs = {
        "prompt_embeds": text,
        "pooled_prompt_embeds": pooled,
        "negative_prompt_embeds": negative,
        "negative_pooled_prompt_embeds": negative_pooled,
        "latents": latents,
        "height": 8,
        "width": 8,
        "num_inference_steps": steps,
        "guidance_scale": 2.5,
        **({**SLG, "skip_layer_guidance_stop": SLG_STOP} if slg else {}),
    }
    theirs_latents = pipe(**kwargs, output_type="latent").images
    theirs_image = pipe(**kwargs, output_type="pt").images
    guide = SkipLayerGuidance((0,), 2.8, 0.01, SLG_STOP) if slg else None
    calls = {0: 0, 1: 0}
    hooks = [
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(model.transformer_blocks)
    ]
    ours_latents = sample_latents(
        model,
        family,
        copy.deepcopy(scheduler),
        latents,
        text,
        steps,
        pooled=pooled,
        negative_text=negative,
        negative_pooled=negative_pooled,
        guidance_scale=2.5,
        skip_guidance=guide,
    )
    for hook in hooks:
        hook.remove()
    # block 0 runs in every conditional and unconditional call and not in the 2 skipped-layer calls, block 1 in all
    assert calls == {0: 2 * steps, 1: 2 * steps + (2 if slg else 0)}
    if slg:
        assert [guide.applies(i, steps) for i in range(steps)] == [False, True, True, False]
        plain = sample_latents(
            model, family, copy.deepcopy(scheduler), latents, text, steps, pooled, negative, negative_pooled, 2.5
        )
        assert (plain - theirs_latents).abs().max() > 1e-2  # skip-layer guidance changed the result
    torch.testing.assert_close(ours_latents, theirs_latents, rtol=1e-6, atol=1e-6)
    ours_image = decode_latents(vae, ours_latents)
    assert ours_image.shape == theirs_image.shape == (2, 3, 8, 8)
    torch.testing.assert_close(ours_image, theirs_image, rtol=1e-6, atol=1e-6)
    assert (ours_latents - latents).abs().mean() > 0.1  # it moved


def test_sd3_skip_layer_guidance_refuses_bad_input() -> None:
    """Out-of-range blocks, a family without ``skip_layers``, no guidance, malformed indices: one line each."""
    from mindspeed_mm.dit_generate import DiTSampleConfig, skip_layer_guidance

    family = DIT_FAMILIES.get(SD3)
    torch.manual_seed(0)
    model = family.load_class()(**family.tiny_config).eval()
    latents, text, pooled = torch.randn(1, 4, 8, 8), torch.randn(1, TEXT_LEN, 48), torch.randn(1, 32)
    guided = {"negative_text": text, "negative_pooled": pooled, "guidance_scale": 2.0}

    def run(guide: SkipLayerGuidance, family=family, **kwargs) -> None:
        sample_latents(model, family, build_scheduler(family), latents, text, 2, pooled, skip_guidance=guide, **kwargs)

    with pytest.raises(ValueError, match=r"^--skip-guidance-layers 1,2: the model has 2 blocks; .* from 0 to 1$"):
        run(SkipLayerGuidance((1, 2)), **guided)
    with pytest.raises(ValueError, match=r"^--skip-guidance-layers: FluxTransformer2DModel has no skip-layer .*remove"):
        run(SkipLayerGuidance((0,)), DIT_FAMILIES.get("FluxTransformer2DModel"), **guided)
    with pytest.raises(ValueError, match=r"^--skip-guidance-layers adds to classifier-free guidance; give --guid"):
        run(SkipLayerGuidance((0,)))
    with pytest.raises(ValueError, match=r"^--skip-guidance-layers '7,x': give comma-separated block indices"):
        skip_layer_guidance(DiTSampleConfig(skip_guidance_layers="7,x"))
    guide = skip_layer_guidance(DiTSampleConfig(skip_guidance_layers="7, 8,9", skip_layer_guidance_stop=0.5))
    assert guide == SkipLayerGuidance((7, 8, 9), 2.8, 0.01, 0.5)


def test_generate_refuses_sd3_flags_for_flux(tmp_path, capsys) -> None:
    """--skip-guidance-layers and --clip-skip on a FLUX pipeline: one line each, naming the flag and the fix."""
    from mindspeed_mm.cli import main
    from mindspeed_mm.demos.t2i import write_t2i_pipeline

    pipe_dir = write_t2i_pipeline(tmp_path / "flux")
    flags = ["--load-dir", str(pipe_dir), "--output-dir", str(tmp_path / "out"), "--prompt", "a red square"]
    flags += ["--height", "8", "--width", "8", "--num-inference-steps", "2", "--text-len", "10"]
    capsys.readouterr()
    for flag, message in (
        (["--clip-skip", "1"], "--clip-skip: FluxTransformer2DModel's prompts take no clip_skip (SD3's do); remove"),
        (
            ["--guidance-scale", "2", "--skip-guidance-layers", "0"],
            "--skip-guidance-layers: FluxTransformer2DModel has",
        ),
    ):
        assert main(["generate", *flags, *flag]) != 0
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(f"mindspeed-mm: error: {message}"), errors


@pytest.mark.parametrize("slg", [False, True], ids=["sd3", "sd3.5-slg"])
def test_generate_sd3_equals_pipeline(tmp_path, slg) -> None:
    """``generate`` = the pipeline from the same directory; with ``slg``: SD3.5's blocks, skip-layer guidance and
    ``clip_skip`` 1 (the prompts' CLIP features; the negative prompt's stay the penultimate's, as the pipeline's)."""
    from diffusers import StableDiffusion3Pipeline
    from PIL import Image

    from mindspeed_mm.cli import main
    from mindspeed_mm.diffusion.media import to_uint8

    pipe_dir = tmp_path / "pipe"
    StableDiffusion3Pipeline(**_tiny_parts(**(SD35 if slg else {}))).save_pretrained(pipe_dir)
    steps = 4 if slg else 3
    flags = ["--height", "8", "--width", "8", "--num-inference-steps", str(steps), "--text-len", str(TEXT_LEN)]
    flags += ["--guidance-scale", "3", "--seed", "7", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    if slg:
        flags += ["--skip-guidance-layers", "0", "--skip-layer-guidance-scale", "2.8"]
        flags += ["--skip-layer-guidance-start", "0.01", "--skip-layer-guidance-stop", str(SLG_STOP)]
        flags += ["--clip-skip", "1"]
    out = tmp_path / "out"
    assert main(["generate", "--load-dir", str(pipe_dir), "--output-dir", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [7, 8]
    assert rows[0]["settings"]["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    reference = StableDiffusion3Pipeline.from_pretrained(pipe_dir)
    for index, (row, prompt) in enumerate(zip(rows, PROMPTS)):
        noise = torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(7 + index))[None]
        image = reference(
            prompt=prompt,
            negative_prompt="",
            latents=noise,
            height=8,
            width=8,
            num_inference_steps=steps,
            guidance_scale=3.0,
            max_sequence_length=T5_LEN,
            output_type="pt",
            **({**SLG, "skip_layer_guidance_stop": SLG_STOP, "clip_skip": 1} if slg else {}),
        ).images
        with Image.open(row["files"][0]) as written:
            np.testing.assert_array_equal(np.asarray(written.convert("RGB")), to_uint8(image)[0])
