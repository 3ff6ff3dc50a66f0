"""Tiny videos, images and a tiny pipeline directory (VAE, text encoders, transformer), built in code (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mindspeed_mm.models.dit import write_tiny_dit
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
    ``tokenizer`` (and FLUX's ``text_encoder_2``, ``tokenizer_2``), matching the transformer's tiny config."""
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
    from diffusers import AutoencoderKL

    model_dir = write_tiny_dit(directory / "transformer", architecture, seed)
    tiny = json.loads((model_dir / "config.json").read_text())
    AutoencoderKL(
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=tiny["in_channels"] // 4,
        norm_num_groups=4,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    ).save_pretrained(str(directory / "vae"))
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
