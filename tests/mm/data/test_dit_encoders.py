"""Feature extraction's encoders against WanPipeline and FluxPipeline: what the cache holds is what the pipeline
feeds the transformer.

- Text: UMT5's outputs for the real tokens, zero-padded by the trainer, equal
  ``WanPipeline.encode_prompt`` (the pipeline's own cleaning, padding and truncation).
- Latents: un-normalised as ``WanPipeline`` does before decoding, the cached latents give back the
  VAE posterior's mode.
- A cache written from them trains (one step, finite loss).
- FLUX: T5 (padding included) and CLIP pooled outputs equal ``FluxPipeline.encode_prompt``; the
  latents, un-normalised as ``FluxPipeline`` does, give back ``AutoencoderKL``'s mode.
"""

from __future__ import annotations

import math

import torch

from mindspeed.launch import launch
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.data.features import write_features
from mindspeed_mm.models.dit import write_tiny_dit
from mindspeed_mm.models.encoders import encode_latents, encode_t5_clip, encode_umt5
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer
from mindspeed_mm.trainer.loop import train

MAX_LEN = 12


def _tiny_encoders():
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer(["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>", chat_template="")
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.5, 2.0, 1.0],
    ).eval()
    return tokenizer, encoder, vae


def _train(config):
    return train(config).records


def test_wan_features_equal_pipeline_inputs(tmp_path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer, encoder, vae = _tiny_encoders()
    model_dir = write_tiny_dit(tmp_path / "transformer", "WanTransformer3DModel")
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=WanTransformer3DModel.from_pretrained(model_dir),
    )
    captions = ["a red  square moves left", "  blue circle &amp; up ", "", "x" * 40]
    texts = encode_umt5(tokenizer, encoder, captions, MAX_LEN)
    assert [t.shape[0] for t in texts] == [
        min(len(" ".join(c.split()).replace("&amp;", "&")), MAX_LEN) for c in captions
    ]
    padded = torch.stack([torch.cat([t, t.new_zeros(MAX_LEN - t.shape[0], t.shape[1])]) for t in texts])
    expected, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN)
    torch.testing.assert_close(padded, expected.detach(), rtol=1e-5, atol=1e-6)  # 5e-7 apart (grad vs no_grad)
    assert torch.equal(padded == 0, expected == 0)  # the same zero padding

    video = torch.rand(2, 3, 9, 16, 16) * 2 - 1
    latents = encode_latents(vae, video)
    assert latents.shape == (2, 4, 3, 2, 2)
    # WanPipeline's un-normalisation before vae.decode gives back the posterior's mode
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        mode = vae.encode(video).latent_dist.mode()
    torch.testing.assert_close(latents / inverse_std + mean, mode, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(latents, mode)

    samples = [{"latents": latents[i % 2], "text": texts[i]} for i in range(4)]
    null = {"text": encode_umt5(tokenizer, encoder, [""], MAX_LEN)[0]}
    cache = write_features(tmp_path / "features", samples, captions, null)
    config = load_mm_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.features={cache}",
            f"data.text_len={MAX_LEN}",
            "train.steps=1",
            "train.micro_batch_size=2",
            "train.precision=fp32",
            "diffusion.text_dropout=0.5",
            "logging.progress=false",
        ],
    )
    records = launch(_train, (config,))
    assert math.isfinite(records[0]["loss"]) and records[0]["loss"] > 0


def test_flux_features_equal_pipeline_inputs(tmp_path) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)

    def tokenizer(max_length: int):
        built = build_byte_tokenizer(["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>", chat_template="")
        built.model_max_length = max_length
        return built

    clip_tokenizer, t5_tokenizer = tokenizer(10), tokenizer(MAX_LEN)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=10,
            eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id,
        )
    ).eval()
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=1,
            num_heads=2,
            pad_token_id=t5_tokenizer.pad_token_id,
        )
    ).eval()
    vae = AutoencoderKL(
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    ).eval()
    model_dir = write_tiny_dit(tmp_path / "transformer", "FluxTransformer2DModel")
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5,
        tokenizer_2=t5_tokenizer,
        transformer=FluxTransformer2DModel.from_pretrained(model_dir),
    )
    captions = ["a red square", "", "a very long caption that T5 and CLIP both cut"]
    ours = encode_t5_clip(clip_tokenizer, clip, t5_tokenizer, t5, captions, MAX_LEN)
    text, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=MAX_LEN)
    torch.testing.assert_close(torch.stack([o["text"] for o in ours]), text.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack([o["pooled"] for o in ours]), pooled.detach(), rtol=1e-5, atol=1e-6)
    assert ours[0]["text"].shape == (MAX_LEN, 32) and ours[0]["pooled"].shape == (32,)

    image = torch.rand(2, 3, 16, 16) * 2 - 1
    latents = encode_latents(vae, image)
    with torch.no_grad():
        mode = vae.encode(image).latent_dist.mode()
    # FluxPipeline's un-normalisation before vae.decode
    torch.testing.assert_close(
        latents / vae.config.scaling_factor + vae.config.shift_factor, mode, rtol=1e-6, atol=1e-6
    )
    assert latents.shape == (2, 4, 8, 8)
