"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): a Whisper-style audio encoder, a
Qwen2.5-VL-style vision encoder, and a Qwen2 LLM with M-RoPE (text out; the talker is not trained here).

Audio: ``<audio>`` becomes ``<|audio_bos|><|AUDIO|><|audio_eos|>``; each clip goes through the model
directory's ``WhisperFeatureExtractor`` as ``Qwen2_5OmniProcessor`` calls it (``padding="max_length"``,
its attention mask renamed ``feature_attention_mask``), and ``<|AUDIO|>`` is repeated once per audio
encoder output frame (``((frames - 1) // 2 + 1 - 2) // 2 + 1``, the processor's rule). Positions:
transformers' own ``get_rope_index`` (audio tokens advance one position per frame on every axis;
images take grid positions; videos are spaced by ``video_second_per_grid`` x ``position_id_per_seconds``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mindspeed_mm.models.family import VLMFamily, register_family
from mindspeed_mm.models.qwen2_5_vl import (
    CHAT_TEMPLATE,
    dummy_video_inputs,
    dummy_vision_inputs,
    image_inputs,
    pixel_bounds,
    video_inputs_for,
)
from mindspeed_mm.models.tiny_tokenizer import build_byte_tokenizer

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]
#: The tokenizer attributes ``Qwen2_5OmniProcessor`` reads (the released tokenizer's ``extra_special_tokens``).
TOKEN_ATTRIBUTES = {
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


def audio_tokens(frames: int) -> int:
    """Audio tokens of a clip of ``frames`` feature frames (two stride-2 reductions, as the processor counts)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def audio_inputs(out: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``input_features`` and ``feature_attention_mask`` of the feature extractor's output; tokens per clip."""
    mask = out["attention_mask"]
    return (
        {"input_features": out["input_features"], "feature_attention_mask": mask},
        [audio_tokens(int(n)) for n in mask.sum(-1)],
    )


#: ``Qwen2_5OmniProcessor``'s rule: ``video_second_per_grid``, one ``<|VIDEO|>`` per merged patch.
video_inputs = video_inputs_for("<|VIDEO|>", "video_second_per_grid")


def dummy_audio_inputs(config: Any) -> dict[str, torch.Tensor]:
    """Four zero feature frames (one audio token: the audio tower's smallest input)."""
    mels = config.audio_config.num_mel_bins
    return {"input_features": torch.zeros(1, mels, 4), "feature_attention_mask": torch.ones(1, 4, dtype=torch.long)}


def rope_positions(model: Any, sample: Any) -> torch.Tensor:
    """[4, 1, L]: the text positions, then transformers' ``get_rope_index`` (audio lengths from the feature mask)."""
    ids = sample.input_ids[None]
    vision = sample.vision
    mask = vision.get("feature_attention_mask")
    rope, _ = model.get_rope_index(
        ids,
        image_grid_thw=vision.get("image_grid_thw"),
        video_grid_thw=vision.get("video_grid_thw"),
        attention_mask=torch.ones_like(ids),
        audio_seqlens=None if mask is None else mask.sum(-1),
        second_per_grids=vision.get("video_second_per_grid"),
    )
    text = torch.arange(ids.shape[1], dtype=rope.dtype).view(1, 1, -1)
    return torch.cat([text, rope.to("cpu")], dim=0)


def write_tiny(directory: Path, seed: int = 0) -> None:
    """A tiny thinker (about 0.3 M parameters) with a byte tokenizer, image and video processors and a
    Whisper feature extractor (16 kHz, 16 mel bins, 2 s clips)."""
    from transformers import (
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    mels = 16
    config = Qwen2_5OmniThinkerConfig(
        audio_config={
            "num_mel_bins": mels,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "n_window": 8,
            "output_dim": 64,
            "max_source_positions": 1500,
            "initializer_range": 0.1,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "initializer_range": 0.1,
        },
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            "tie_word_embeddings": False,
            "initializer_range": 0.1,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=ids["<|im_start|>"],
        initializer_range=0.1,
        tie_word_embeddings=False,
        architectures=["Qwen2_5OmniThinkerForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112).save_pretrained(directory)
    Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=112 * 112, cap_pixels_per_frame=False).save_pretrained(
        directory
    )
    WhisperFeatureExtractor(feature_size=mels, sampling_rate=16000, chunk_length=2).save_pretrained(
        Path(directory) / AUDIO_PROCESSOR_DIR
    )


#: Where :func:`write_tiny` keeps the feature extractor (the image processor holds preprocessor_config.json).
AUDIO_PROCESSOR_DIR = "audio_processor"

QWEN2_5_OMNI = register_family(
    VLMFamily(
        architecture="Qwen2_5OmniThinkerForConditionalGeneration",
        model_class="transformers:Qwen2_5OmniThinkerForConditionalGeneration",
        encoders={"image": ("visual",), "video": ("visual",), "audio": ("audio_tower",)},
        parts={
            "vision_tower": ("visual.patch_embed", "visual.blocks", "audio_tower"),
            "projector": ("visual.merger",),
            "language_model": ("model", "lm_head"),
        },
        fsdp_plan=("visual.blocks.{*}", "visual", "audio_tower", "model.layers.{*}"),
        image_placeholder="<|vision_bos|><|IMAGE|><|vision_eos|>",
        image_token="<|IMAGE|>",
        image_inputs=image_inputs,
        positions=rope_positions,
        write_tiny=write_tiny,
        language_module="model",
        dummy_vision_inputs=dummy_vision_inputs,
        vision_module="visual",
        processor_overrides=pixel_bounds,
        video_placeholder="<|vision_bos|><|VIDEO|><|vision_eos|>",
        video_token="<|VIDEO|>",
        video_inputs=video_inputs,
        dummy_video_inputs=dummy_video_inputs,
        audio_placeholder="<|audio_bos|><|AUDIO|><|audio_eos|>",
        audio_token="<|AUDIO|>",
        audio_inputs=audio_inputs,
        dummy_audio_inputs=dummy_audio_inputs,
    )
)
