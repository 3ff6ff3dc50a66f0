"""InternVL (``InternVLForConditionalGeneration``, InternVL3 / 3.5 in transformers' layout): an InternViT, a pixel-shuffle MLP projector, a Qwen2/Qwen3 LLM with 1-D rope.

An image is cut into tiles as transformers' ``InternVLProcessor`` cuts it: the processor calls
its image processor with ``crop_to_patches=True`` whatever the directory's
``preprocessor_config.json`` says (``InternVLProcessorKwargs``' call defaults), so the image
processor is loaded with those defaults (:func:`processor_tiling`). The image is resized to the
grid of ``size`` tiles (448 x 448 in InternVL3) whose aspect ratio is closest to its own, from
``min_patches`` to ``max_patches`` tiles (the directory's, 1 and 12 by default), and a
thumbnail of the whole image is added when there is more than one tile (GotOcr2's
``crop_image_to_patches``). Each tile is ``image_seq_length`` ``<IMG_CONTEXT>`` tokens, and an
image's tiles sit between one ``<img>`` and ``</img>``. Positions are plain 1-D positions
restarting in each packed sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.family import VLMFamily, register_family
from mindspeed_mm.models.qwen2_5_vl import CHAT_TEMPLATE
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]


def image_inputs(out: Any, image_processor: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Tiles; ``image_seq_length`` tokens per tile (from the model's config.json, set by ``load_processing``)."""
    per_tile = int(getattr(image_processor, "image_seq_length", 256))
    tiles = out["num_patches"]
    tiles = tiles.tolist() if hasattr(tiles, "tolist") else list(tiles)
    return {"pixel_values": out["pixel_values"]}, [per_tile * int(n) for n in tiles]


def processor_tiling(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """The image kwargs ``InternVLProcessor`` calls its image processor with (tiles and a thumbnail); InternVL
    bounds images by tiles, not pixels, so the pixel bounds are not used."""
    from transformers.models.internvl.processing_internvl import InternVLProcessorKwargs

    return dict(InternVLProcessorKwargs._defaults.get("images_kwargs", {}))


def video_inputs(out: Any, video_processor: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every frame one tile; ``Frame{i}: <img>...</img>`` lines (``InternVLProcessor.replace_video_token``)."""
    per_tile = int(getattr(video_processor, "image_seq_length", 256))
    videos = out["pixel_values_videos"]
    texts = [
        "\n".join(f"Frame{i + 1}: <img>" + "<IMG_CONTEXT>" * per_tile + "</img>" for i in range(video.shape[0]))
        for video in videos
    ]
    return {"pixel_values": videos.flatten(0, 1)}, texts


def text_positions(model: Any, sample: Any) -> torch.Tensor:
    """[1, L]: 0 .. L-1."""
    return torch.arange(sample.input_ids.numel())[None]


def dummy_vision_inputs(config: Any) -> dict[str, torch.Tensor]:
    """One black tile."""
    size = config.vision_config.image_size
    height, width = (size, size) if isinstance(size, int) else size
    return {"pixel_values": torch.zeros(1, config.vision_config.num_channels, height, width)}


def write_tiny(directory: Path, seed: int = 0) -> None:
    """A tiny InternVL (56 x 56 tiles of 14 x 14 patches, 4 tokens per tile, at most 12 tiles and a thumbnail) with
    a byte tokenizer."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [56, 56],
            "patch_size": [14, 14],
            "initializer_range": 0.1,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "initializer_range": 0.1,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=4,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
        architectures=["InternVLForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56},
        crop_to_patches=False,  # as a directory may say: InternVLProcessor (and our loading) tile all the same
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(directory)
    InternVLVideoProcessor(
        size={"height": 56, "width": 56}, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
    ).save_pretrained(directory)


INTERNVL = register_family(
    VLMFamily(
        architecture="InternVLForConditionalGeneration",
        model_class="transformers:InternVLForConditionalGeneration",
        encoders={"image": ("model.vision_tower", "model.multi_modal_projector")},
        parts={
            "vision_tower": ("model.vision_tower",),
            "projector": ("model.multi_modal_projector",),
            "language_model": ("model.language_model", "lm_head"),
        },
        fsdp_plan=("model.vision_tower.encoder.layer.{*}", "model.vision_tower", "model.language_model.layers.{*}"),
        image_placeholder="<img><IMG_CONTEXT></img>",
        image_token="<IMG_CONTEXT>",
        image_inputs=image_inputs,
        positions=text_positions,
        write_tiny=write_tiny,
        language_module="model.language_model",
        dummy_vision_inputs=dummy_vision_inputs,
        processor_overrides=processor_tiling,
        vision_module="model.vision_tower",
        video_placeholder="<video>",
        video_token="<video>",
        video_inputs=video_inputs,  # frames join pixel_values: one vision call, no dummy video needed
    )
)
