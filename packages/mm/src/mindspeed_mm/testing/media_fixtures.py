"""Tiny videos, images and a tiny pipeline directory (VAE, text encoders, transformer), built in code (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mindspeed_mm.models.dit import DIT_FAMILIES, write_tiny_dit
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer


def write_video(path: str | Path, frames: np.ndarray, fps: int, codec: str = "png") -> Path:
    """Write uint8 ``[F, H, W, 3]`` frames with PyAV (``png`` in a .mov is lossless and records its frame count)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_image(path: str | Path, pixels: np.ndarray) -> Path:
    """Write uint8 ``[H, W, 3]`` pixels as an image (the suffix picks the format)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def _tokenizer(directory: Path, max_length: int) -> None:
    tokenizer = build_byte_tokenizer(["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>", chat_template="")
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(directory))


def write_tiny_pipeline(directory: str | Path, architecture: str, seed: int = 0) -> Path:
    """A diffusers-layout pipeline directory with tiny random parts: ``transformer``, ``vae``, ``text_encoder``,
    ``tokenizer`` (and FLUX's ``text_encoder_2``, ``tokenizer_2``; SD3's three text encoders and tokenizers;
    Qwen-Image's tiny Qwen2.5-VL and ``AutoencoderKLQwenImage``), matching the transformer's tiny config."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    directory = Path(directory)
    vocab = 256 + 2
    torch.manual_seed(seed)
    if architecture == "WanTransformer3DModel":
        from diffusers import AutoencoderKLWan

        model_dir = write_tiny_dit(directory / "transformer", architecture, seed)
        tiny = json.loads((model_dir / "config.json").read_text())
        channels = tiny["in_channels"]
        AutoencoderKLWan(
            base_dim=3,
            z_dim=channels,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1 * i for i in range(channels)],
            latents_std=[1.0 + 0.1 * i for i in range(channels)],
        ).save_pretrained(str(directory / "vae"))
        UMT5EncoderModel(
            UMT5Config(
                vocab_size=vocab, d_model=tiny["text_dim"], d_kv=8, d_ff=32, num_layers=1, num_heads=2, pad_token_id=256
            )
        ).save_pretrained(str(directory / "text_encoder"))
        _tokenizer(directory / "tokenizer", 512)
        return directory
    if architecture == "QwenImageTransformer2DModel":  # the suite's tiny Qwen2.5-VL, its VAE with normalisation
        from diffusers import AutoencoderKLQwenImage
        from transformers import AutoTokenizer

        from mindspeed_mm.models.qwen2_5_vl import write_tiny

        write_tiny_dit(directory / "transformer", architecture, seed)
        AutoencoderKLQwenImage(
            base_dim=24,
            z_dim=4,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.8, 1.2, 1.0],
        ).save_pretrained(str(directory / "vae"))
        write_tiny(directory / "text_encoder", seed)
        AutoTokenizer.from_pretrained(str(directory / "text_encoder")).save_pretrained(str(directory / "tokenizer"))
        return directory
    from diffusers import AutoencoderKL

    model_dir = write_tiny_dit(directory / "transformer", architecture, seed)
    tiny = json.loads((model_dir / "config.json").read_text())
    family = DIT_FAMILIES.get(architecture)
    AutoencoderKL(
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=family.latent_channels(tiny),
        norm_num_groups=4,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    ).save_pretrained(str(directory / "vae"))
    if architecture == "SD3Transformer2DModel":  # two CLIPs with projection (pooled: both), a T5 of the joint width
        from transformers import CLIPTextModelWithProjection

        for name in ("text_encoder", "text_encoder_2"):
            CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=vocab,
                    hidden_size=16,
                    projection_dim=tiny["pooled_projection_dim"] // 2,
                    intermediate_size=37,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    max_position_embeddings=10,
                    bos_token_id=257,
                    eos_token_id=257,
                    pad_token_id=256,
                )
            ).save_pretrained(str(directory / name))
        T5EncoderModel(
            T5Config(
                vocab_size=vocab,
                d_model=tiny["joint_attention_dim"],
                d_kv=8,
                d_ff=37,
                num_layers=1,
                num_heads=2,
                pad_token_id=256,
            )
        ).save_pretrained(str(directory / "text_encoder_3"))
        for name, length in (("tokenizer", 10), ("tokenizer_2", 10), ("tokenizer_3", 512)):
            _tokenizer(directory / name, length)
        return directory
    CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab,
            hidden_size=tiny["pooled_projection_dim"],
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=10,
            bos_token_id=257,
            eos_token_id=257,
            pad_token_id=256,
        )
    ).save_pretrained(str(directory / "text_encoder"))
    T5EncoderModel(
        T5Config(
            vocab_size=vocab,
            d_model=tiny["joint_attention_dim"],
            d_kv=8,
            d_ff=37,
            num_layers=1,
            num_heads=2,
            pad_token_id=256,
        )
    ).save_pretrained(str(directory / "text_encoder_2"))
    _tokenizer(directory / "tokenizer", 10)
    _tokenizer(directory / "tokenizer_2", 512)
    return directory


def tiny_i2v_parts(seed: int = 0, image_dim: int | None = 16, flf2v: bool = False) -> dict:
    """The components of a tiny ``WanImageToVideoPipeline``, built in code: the I2V family's tiny transformer
    (with ``flf2v`` the FLF2V family's: position embeddings over two images' features), a tiny ``AutoencoderKLWan``
    (4 latent channels, time stride 4, space stride 8), a tiny UMT5 with a byte tokenizer, a tiny CLIP vision model
    (``image_dim`` features; none with ``image_dim=None``, Wan2.2 I2V) and its image processor, and Wan's UniPC
    scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from mindspeed_mm.models.dit import DIT_FAMILIES

    family = DIT_FAMILIES.get("WanTransformer3DModel:flf2v" if flf2v else "WanTransformer3DModel:i2v")
    torch.manual_seed(seed)
    config = {**family.tiny_config}
    if image_dim is None:
        config.update(image_dim=None, added_kv_proj_dim=None)
    parts = {"transformer": family.load_class()(**config).eval()}
    parts["vae"] = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.5, 2.0, 1.0],
    ).eval()
    tokenizer = build_byte_tokenizer(["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>", chat_template="")
    tokenizer.model_max_length = 512
    parts["tokenizer"] = tokenizer
    parts["text_encoder"] = UMT5EncoderModel(
        UMT5Config(
            vocab_size=258, d_model=config["text_dim"], d_kv=8, d_ff=32, num_layers=1, num_heads=2, pad_token_id=256
        )
    ).eval()
    parts["image_encoder"], parts["image_processor"] = None, None
    if image_dim is not None:
        parts["image_encoder"] = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=image_dim,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            )
        ).eval()
        parts["image_processor"] = CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32})
    parts["scheduler"] = UniPCMultistepScheduler(**family.scheduler[1])
    return parts


def tiny_wan22_vae(seed: int = 1, z_dim: int = 48) -> Any:
    """A tiny ``AutoencoderKLWan`` in the Wan2.2 (TI2V-5B) configuration as diffusers ships it: residual
    blocks (``is_residual``), 2 x 2 pixel patches in and out (``patch_size`` 2, 12 channels), space stride 16,
    time stride 4, ``z_dim`` 48 with per-channel ``latents_mean`` / ``latents_std``; 8 base channels."""
    from diffusers import AutoencoderKLWan

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=(torch.randn(z_dim, generator=gen) * 0.1).tolist(),
        latents_std=(torch.rand(z_dim, generator=gen) + 0.5).tolist(),
    ).eval()


def tiny_ti2v_parts(seed: int = 0) -> dict:
    """The components of a tiny Wan2.2 TI2V-5B pipeline (``WanPipeline`` / ``WanImageToVideoPipeline`` with
    ``expand_timesteps``), built in code: the ``ti2v`` family's tiny transformer with the VAE's 48 channels in and
    out, :func:`tiny_wan22_vae`, a tiny UMT5 with a byte tokenizer and Wan's UniPC scheduler."""
    from diffusers import UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from mindspeed_mm.models.dit import DIT_FAMILIES

    family = DIT_FAMILIES.get("WanTransformer3DModel:ti2v")
    torch.manual_seed(seed)
    config = {**family.tiny_config, "in_channels": 48, "out_channels": 48}
    parts = {"transformer": family.load_class()(**config).eval(), "vae": tiny_wan22_vae(seed + 1)}
    tokenizer = build_byte_tokenizer(["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>", chat_template="")
    tokenizer.model_max_length = 512
    parts["tokenizer"] = tokenizer
    parts["text_encoder"] = UMT5EncoderModel(
        UMT5Config(
            vocab_size=258, d_model=config["text_dim"], d_kv=8, d_ff=32, num_layers=1, num_heads=2, pad_token_id=256
        )
    ).eval()
    parts["scheduler"] = UniPCMultistepScheduler(**family.scheduler[1])
    return parts
